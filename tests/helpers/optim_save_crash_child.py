"""The child side of test_crash_save: imported once by the fork server (preload), so each saver process starts
warm (torch, swapio and the optimizer's lazily imported pieces are loaded already)."""
import signal

import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS

SHAPES = [(5000,), (70, 90), (12001,)]
def make_optimizer(mode, swap_dir):
    params = [torch.zeros(s, requires_grad=True) for s in SHAPES]
    extra = {"swap_dir": swap_dir, **SMALL_BUFFERS} if mode == "nvme" else {}
    return so.OffloadAdamW(params, offload=mode, **extra)


def uniform_state(opt, k):
    """A state dict in which every number says k: a checkpoint of it read back as a mix is caught."""
    sd = opt.state_dict()
    sd["state"] = {i: {"step": torch.tensor(float(k)), "exp_avg": torch.full(s, k + 0.25),
                       "exp_avg_sq": torch.full(s, k + 0.5)} for i, s in enumerate(SHAPES)}
    return sd


def saver(mode, swap_dir, ckpt, first, saved, saving):
    """Child: saves checkpoints first, first+1, ... until killed; saved.value: the last save that returned."""
    # Ctrl-C raises here even when the test runs where SIGINT is ignored (a non-interactive shell's background
    # job), which the fork server and its children would otherwise inherit.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    opt = make_optimizer(mode, swap_dir)
    k = first
    while True:
        opt.load_state_dict(uniform_state(opt, k))
        saving.value = 1
        opt.save(ckpt)
        saving.value = 0
        saved.value = k
        k += 1


def loaded_k(ckpt, mode, swap_dir):
    opt = make_optimizer(mode, swap_dir)
    opt.load(ckpt)
    sd = opt.state_dict()
    k = sd["state"][0]["step"].item()
    for i, s in enumerate(SHAPES):
        st = sd["state"][i]
        assert st["step"].item() == k
        assert torch.equal(st["exp_avg"], torch.full(s, k + 0.25)), (i, k)
        assert torch.equal(st["exp_avg_sq"], torch.full(s, k + 0.5)), (i, k)
    opt.close()
    return int(k)



make_optimizer("cpu", None).close()  # warm up: the first optimizer of a process pays for lazy imports
