"""The child side of test_checkpoint_crash: imported once by the fork server (preload), so each saver starts warm."""
import signal

import torch

import swapio.checkpoint

SHAPES = [(600_000,), (300, 900), (5,), (1_100_000,)]  # ~8 MiB in all: many 1 MiB windows per save
STAGING = 2 << 20


def uniform_state(k):
    """A state in which every number says k: a file read back as a mix of two saves is caught."""
    return {"model": {f"t{i}": torch.full(s, float(k)) for i, s in enumerate(SHAPES)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(k))}}, "param_groups": [{"lr": 0.1}]},
            "step": k}


def saver(ckpt, first, saved, saving, asynchronous):
    """Saves checkpoints first, first+1, ... until killed; saved.value: the last save that returned."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises even where the test's shell ignores it
    k = first
    while True:
        state = uniform_state(k)
        saving.value = 1
        if asynchronous:
            swapio.checkpoint.async_save(state, ckpt, staging_bytes=STAGING).wait()
        else:
            swapio.checkpoint.save(state, ckpt, staging_bytes=STAGING)
        saving.value = 0
        saved.value = k
        k += 1


def loaded_k(ckpt):
    state = swapio.checkpoint.load(ckpt)
    k = state["step"]
    assert state["optimizer"]["state"][0]["step"].item() == k
    for i, s in enumerate(SHAPES):
        assert torch.equal(state["model"][f"t{i}"], torch.full(s, float(k))), (i, k)
    return k
