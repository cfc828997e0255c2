"""Soak: many create-use-drop cycles of each feature in one process leave descriptors, threads, pinned bytes
(swapio's own counters) and files where they were. Each cycle also ends one way a user's code does: close(), a
plain drop (the garbage collector must free everything) or an exception raised mid-use."""
import gc
import os
import threading

import pytest
import torch

import swapio
from swapio import _C
from swapio.core.pinned import pinned_bytes

CYCLES = 20


class Boom(Exception):
    pass


def _resources(directory):
    gc.collect()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "tasks": len(os.listdir("/proc/self/task")), "pinned": pinned_bytes()[0],
            "held": sorted(_C.held_bytes().items()),
            "files": sum(len(fs) for _, _, fs in os.walk(directory))}  # (names may change: disk_offload's do)


def _soak(cycle, directory):
    for _ in range(2):  # warm-up: lazily created process-wide pools and threads are not leaks
        cycle()
    before = _resources(directory)
    for _ in range(CYCLES):
        cycle()
    assert _resources(directory) == before


def _model():
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _step(opt, model):
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("ending", ["close", "drop", "raise"])
def test_swap_store_cycles(tmp_path, ending):
    directory = tmp_path / "store"

    def cycle():
        store = swapio.SwapStore(directory)
        swapped = store.swap_out(torch.randn(256))
        swapped.swap_in().wait()
        if ending == "close":
            store.close()
        elif ending == "raise":
            with pytest.raises(Boom):
                with store:
                    store.swap_out(torch.randn(256))
                    raise Boom
        else:
            del store, swapped
            gc.collect()  # (a SwappedTensor keeps its store alive: the two form a cycle)
    _soak(cycle, tmp_path)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("ending", ["close", "drop", "raise"])
def test_offload_adamw_cycles(tmp_path, offload, ending):
    kwargs = {"offload": offload, "swap_dir": tmp_path} if offload == "nvme" else {"offload": "cpu"}
    saved = tmp_path.parent / f"{tmp_path.name}-saved"

    def cycle():
        model = _model()
        opt = swapio.optim.OffloadAdamW(model.parameters(), **kwargs)
        _step(opt, model)
        opt.save(saved)
        opt.load(saved)
        if ending == "close":
            opt.close()
        elif ending == "raise":
            with pytest.raises(Boom):
                with opt:
                    _step(opt, model)
                    raise Boom
        else:
            del opt
    _soak(cycle, tmp_path)


@pytest.mark.parametrize("ending", ["close", "drop"])
def test_offload_adafactor_nvme_cycles(tmp_path, ending):
    def cycle():
        model = _model()
        opt = swapio.optim.OffloadAdafactor(model.parameters(), offload="nvme", swap_dir=tmp_path)
        _step(opt, model)
        if ending == "close":
            opt.close()
    _soak(cycle, tmp_path)


@pytest.mark.parametrize("ending", ["close", "drop", "raise", "no_backward"])
def test_activation_offload_nvme_cycles(tmp_path, ending):
    def cycle():
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        offload = swapio.offload.offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0)
        x = torch.randn(16, 64, requires_grad=True)
        if ending == "raise":
            with pytest.raises(Boom):
                with offload:
                    model(x).sum()
                    raise Boom
        else:
            with offload:
                loss = model(x).sum()
            if ending != "no_backward":
                loss.backward()
        if ending in ("close", "raise"):
            offload.close()
    _soak(cycle, tmp_path)


@pytest.mark.parametrize("kind", ["disk", "cpu", "disk_drop"])
def test_weight_offload_cycles(tmp_path, kind):
    def cycle():
        model = _model()
        if kind.startswith("disk"):
            swapio.offload.disk_offload(model, tmp_path / "weights", execution_device="cpu")
        else:
            swapio.offload.cpu_offload(model, execution_device="cpu")
        model(torch.randn(2, 16))
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 17))  # a failing forward between good ones
        if kind != "disk_drop":
            swapio.offload.remove_offload(model)
    _soak(cycle, tmp_path)


def test_checkpoint_cycles(tmp_path):
    state = {"a": torch.randn(256), "b": torch.randn(8, 8)}
    path = tmp_path / "c.safetensors"

    def cycle():
        swapio.checkpoint.save(state, path)
        swapio.checkpoint.load(path)
        swapio.checkpoint.async_save(state, path).wait()
        with pytest.raises(FileNotFoundError):
            swapio.checkpoint.save(state, tmp_path / "missing" / "c.safetensors")
        with pytest.raises(FileNotFoundError):
            swapio.checkpoint.load(tmp_path / "missing.safetensors")
    _soak(cycle, tmp_path)
