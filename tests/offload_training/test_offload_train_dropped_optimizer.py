"""An in_backward=True optimizer dropped by the program (no close()) right after or during a backward: the update is
part of the backward, as with torch's optimizer-in-backward hooks, so every update that backward began lands
exactly once, remove_offload() and the next forward wait for it, and the optimizer is freed once it is done (no
cycle keeps it). What it cannot finish any more is a RuntimeError at the next forward or remove_offload(), never a
silent half-update. The worker's timing is held with an event (a gate in OffloadedParams.update), not sleeps;
weights are checked against a resident copy stepped by torch.optim.AdamW."""
import errno
import gc
import os
import threading
import weakref

import pytest
import torch

from swapio.offload import remove_offload
from swapio.optim import OffloadAdamW
from swapio.optim.cpu_state import CpuState
from swapio.optim.offloaded import OffloadedParams
from helpers.offload_training import MLP, batches, loss_of, make_model, offload, one_thread, weights

pytest.importorskip("safetensors")

LR, DECAY = 1e-2, 0.01


class Spare(MLP):
    """A weight in each module that forward never uses: backward reaches every module's record but cannot complete
    it, so in_backward=True leaves every gradient to step()."""

    def __init__(self):
        super().__init__()
        for module in (self.a, self.norm, self.b, self.c):
            module.spare = torch.nn.Parameter(torch.zeros(2))


def torch_step(data, forward=loss_of, cls=MLP):
    """{name: weight} of the resident model after one torch.optim.AdamW step on data[0]."""
    model = make_model(cls)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    with one_thread():
        forward(model, data[0]).backward()
    opt.step()
    return weights(model)


def assert_close_weights(got, want):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)


def build(model, off, tmp_path):
    kw = dict(swap_dir=str(tmp_path / "swap")) if off == "nvme" else {}
    return OffloadAdamW(model.parameters(), lr=LR, weight_decay=DECAY, offload=off, in_backward=True, **kw)


@pytest.fixture
def gate(monkeypatch):
    """Holds every update of the in_backward worker until gate.set(); gate.fail: the error the first one raises."""
    release = threading.Event()
    release.fail = None
    real = OffloadedParams.update

    def update(self, *args):
        release.wait()
        if release.fail is not None:
            error, release.fail = release.fail, None
            raise error
        return real(self, *args)
    monkeypatch.setattr(OffloadedParams, "update", update)
    yield release
    release.set()


@pytest.fixture
def no_gc():
    """Reference counting alone must free a dropped optimizer (a cycle would wait for the collector)."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("storage", ["disk", "cpu"])
@pytest.mark.parametrize("off", ["cpu", "nvme"])
@pytest.mark.parametrize("then", ["remove_offload", "forward"])
def test_updates_queued_by_backward_land_once_when_the_optimizer_is_dropped_right_after(tmp_path, gate, no_gc,
                                                                                          storage, off, then):
    data = batches(MLP, 1)
    want = torch_step(data)
    model = offload(make_model(MLP), storage, tmp_path)
    seen = []

    def built():
        opt = build(model, off, tmp_path)
        seen.append((weakref.ref(opt), opt.swap_path))
        return opt
    with one_thread():
        (built(), loss_of(model, data[0]).backward())  # the optimizer is dropped as the statement ends
    (dropped, swap), = seen
    assert dropped() is not None  # its queued updates hold it (and its state, its swap file)
    gc.enable()
    gc.collect()  # nothing to collect: the worker's queued run holds it
    gc.disable()
    assert dropped() is not None
    gate.set()
    if then == "forward":
        with torch.no_grad(), one_thread():
            out = model(data[0][0])  # waits for the updates: reads the new weights
        assert dropped() is None
    remove_offload(model)
    assert dropped() is None
    if swap is not None:
        assert not os.path.exists(swap)  # freed with it
    assert_close_weights(weights(model), want)
    if then == "forward":
        with torch.no_grad(), one_thread():
            assert torch.equal(model(data[0][0]), out)


def test_del_and_gc_collect_between_backward_and_the_next_forward(tmp_path, gate, no_gc):
    data = batches(MLP, 1)
    want = torch_step(data)
    model = offload(make_model(MLP), "disk", tmp_path)
    opt = build(model, "cpu", tmp_path)
    with one_thread():
        loss_of(model, data[0]).backward()
    dropped = weakref.ref(opt)
    del opt
    gc.enable()
    gc.collect()
    gc.disable()
    assert dropped() is not None
    threading.Timer(0, gate.set).start()  # released while the next forward waits for the worker
    with torch.no_grad(), one_thread():
        model(data[0][0])
    assert dropped() is None
    remove_offload(model)
    assert_close_weights(weights(model), want)


def _forward_dropping_at_a(model, batch, on_a=None):
    """loss_of's computation, with on_a() run in backward once the gradients of c, b and norm are in, before a's."""
    x, y = batch
    h = torch.tanh(model.a(x))
    if on_a is not None:
        h.register_hook(lambda g: on_a())
    out = model.c(torch.tanh(model.b(model.norm(h))))
    return torch.nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_an_optimizer_dropped_in_the_middle_of_backward_updates_every_module_of_it(tmp_path, no_gc, storage):
    data = batches(MLP, 1)
    want = torch_step(data, _forward_dropping_at_a)
    model = offload(make_model(MLP), storage, tmp_path)
    held = [build(model, "cpu", tmp_path)]
    dropped = weakref.ref(held[0])

    def drop():
        held[0]._offloaded.wait()  # c, b and norm are updated: the worker is idle, nothing of it holds the optimizer
        held.clear()
        assert dropped() is not None  # the backward holds it until it ends
    with one_thread():
        _forward_dropping_at_a(model, data[0], drop).backward()
    assert not held
    remove_offload(model)
    assert dropped() is None
    assert_close_weights(weights(model), want)


@pytest.mark.parametrize("then", ["forward", "remove_offload"])
@pytest.mark.parametrize("where", ["update", "state"])
def test_a_failed_update_of_a_dropped_optimizer_is_raised_by_the_next_forward_or_remove_offload(tmp_path, gate,
                                                                                                  monkeypatch, no_gc,
                                                                                                  then, where):
    # where: before the optimizer's step (a gate), or inside it (its state refused memory: the error's traceback
    # runs through the optimizer's frames, which must not keep it alive)
    data = batches(MLP, 1)
    model = offload(make_model(MLP), "disk", tmp_path)
    before = weights(make_model(MLP))
    opt = build(model, "cpu", tmp_path)
    with one_thread():
        loss_of(model, data[0]).backward()
    dropped = weakref.ref(opt)
    del opt
    if where == "update":
        gate.fail = OSError(errno.EIO, "injected", "state")
    else:
        monkeypatch.setattr(CpuState, "_empty", lambda *a: (_ for _ in ()).throw(MemoryError("pinned memory refused")))
    gate.set()
    with pytest.raises(RuntimeError, match="dropped") as raised:
        if then == "forward":
            with torch.no_grad():
                model(data[0][0])
        else:
            remove_offload(model)
    assert isinstance(raised.value.__cause__, OSError if where == "update" else MemoryError)
    assert dropped() is None
    remove_offload(model)  # raised once; the model is as the failed update left it: untouched here
    assert all(torch.equal(a, b) for a, b in zip(weights(model).values(), before.values()))


def test_gradients_left_for_step_by_a_dropped_optimizer_are_a_runtime_error_not_lost(tmp_path, no_gc):
    # Records with a weight backward never reaches: backward hands none of them to the worker, step() would apply
    # their gradients; dropped before step(), it cannot.
    data = batches(MLP, 2)
    model = offload(make_model(Spare), "disk", tmp_path, Spare)
    before = weights(make_model(Spare))
    opt = build(model, "cpu", tmp_path)
    with one_thread():
        loss_of(model, data[0]).backward()
    del opt
    with pytest.raises(RuntimeError, match="step"):
        with torch.no_grad():
            model(data[0][0])
    remove_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(weights(model).values(), before.values()))


@pytest.mark.parametrize("end", ["step", "close"])
def test_an_optimizer_stepped_or_closed_before_it_is_dropped_reports_nothing(tmp_path, no_gc, end):
    # step() applied what backward left; close() discards it, as the program asked
    data = batches(MLP, 2)
    want = torch_step(data, cls=Spare) if end == "step" else weights(make_model(Spare))
    model = offload(make_model(Spare), "disk", tmp_path, Spare)
    opt = build(model, "cpu", tmp_path)
    with one_thread():
        loss_of(model, data[0]).backward()  # backward leaves every gradient to step() (Spare)
    opt.step() if end == "step" else opt.close()
    dropped = weakref.ref(opt)
    del opt
    assert dropped() is None
    with torch.no_grad():
        model(data[0][0])
    remove_offload(model)
    assert_close_weights(weights(model), want)
