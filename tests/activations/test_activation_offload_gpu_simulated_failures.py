"""Activation offload of GPU tensors on the simulated CUDA layer (helpers/fake_gpu_activations), when a read, a
copy back or the backward fails: every pinned block goes back to the pool, none before the disk is done with it."""
import errno

import pytest
import torch

from helpers.activations import assert_same_grads, batch, grads_of, make_stack
from helpers.autograd import OnBackward
from helpers.fake_gpu_activations import all_back, gpu, watched_offload  # noqa: F401 (gpu: a fixture)


class _RefusedRead:
    """The offload's handle, whose pread number `which` is refused at submission (the swap file replaced under it,
    ESTALE; out of descriptors, EMFILE), or fails once submitted (fail_late)."""

    def __init__(self, act, which, fail_late=False):
        self.inner, self.which, self.fail_late, self.calls = act._res.handle, which, fail_late, 0
        act._res.handle = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pread(self, *args, **kwargs):
        self.calls += 1
        if self.calls != self.which:
            return self.inner.pread(*args, **kwargs)
        if not self.fail_late:
            raise OSError(errno.ESTALE, "Stale file handle")
        return self.inner.pread(*args, **kwargs)._chain(_eio)


def _eio(_):
    raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("fail_late", [False, True])
def test_a_failed_read_of_the_backward_gives_its_pinned_block_back(gpu, tmp_path, prefetch, fail_late):
    # The copy back to the device reads a pinned block of the pool that the disk's read fills. A read refused at
    # submission left its block counted in use for good (stats' pinned_bytes, never reused); one that failed
    # once submitted never queued the copy that gives the block back, nor did the loads read ahead that the
    # failed unpack let go.
    model, x = make_stack(), batch(t=16)
    want = grads_of(model, x)
    act, pool = watched_offload(gpu, "nvme", tmp_path, model=model, prefetch=prefetch)
    _RefusedRead(act, which=2, fail_late=fail_late)
    with pytest.raises(OSError, match="Stale file handle" if not fail_late else "Input/output error"):
        grads_of(model, x, act)
    gpu.run_all()
    assert all_back(pool), f"{pool.in_use} bytes of pinned blocks counted in use for good"
    assert act.stats()["pinned_bytes"] == pool.cached
    assert_same_grads(grads_of(model, x, act), want)  # and the next step as before
    assert all_back(pool)
    act.close()


def _fail():
    raise RuntimeError("simulated failure in backward")


@pytest.mark.parametrize("to", ["cpu", "nvme"])
def test_reads_ahead_that_a_failed_backward_never_used_give_their_blocks_back(gpu, tmp_path, to):
    # A node fails in backward after the unpacks above it read ahead the storages below: the graph goes with
    # those loads never waited for. Their blocks go back to the pool, not before their reads finished.
    model, x = make_stack(), batch(t=16)
    act, pool = watched_offload(gpu, to, tmp_path, model=model, prefetch=4)
    first, rest = model.blocks[0], model.blocks[1:]
    xx = x.clone().requires_grad_(True)
    with act:
        h = OnBackward.apply(first(xx), _fail)
        for block in rest:
            h = block(h)
        loss = h.square().mean()
    with pytest.raises(RuntimeError, match="simulated failure"):
        loss.backward()
    del loss, h
    gpu.run_all()
    assert all_back(pool), f"{pool.in_use} bytes of pinned blocks counted in use for good"
    act.close()


def test_a_copy_back_that_fails_to_queue_gives_its_pinned_block_back(gpu, tmp_path, monkeypatch):
    from swapio.offload import activation_store
    model, x = make_stack(), batch(t=16)
    act, pool = watched_offload(gpu, "nvme", tmp_path, model=model, prefetch=0)
    real, calls = activation_store.copy_async, []

    def failing_second_copy_back(dst, src, stream, wait_for=None, hold=True):
        if stream is gpu.sides["to_device"]:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(dst, src, stream, wait_for, hold)
    monkeypatch.setattr(activation_store, "copy_async", failing_second_copy_back)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        grads_of(model, x, act)
    gpu.run_all()
    assert all_back(pool), f"{pool.in_use} bytes of pinned blocks counted in use for good"
    act.close()


def test_a_ctrl_c_while_an_interrupted_forward_waits_for_its_copies_leaves_their_blocks_to_them(gpu, monkeypatch):
    # A forward interrupted (Ctrl-C) discards what it saved, waiting for the copies to the host still running
    # into their pinned blocks. A second Ctrl-C during that wait gave the blocks back as free: the next forward's
    # save was handed one that a late copy then wrote into.
    from helpers.fake_cuda import Event
    act, pool = watched_offload(gpu, "cpu", None)
    w = torch.randn(256, 256, requires_grad=True)
    real = Event.synchronize

    def second_ctrl_c(event):
        monkeypatch.setattr(Event, "synchronize", real)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with act:
            discarded = (w * 1).sin()  # saved: its copy to the host is queued
            monkeypatch.setattr(Event, "synchronize", second_ctrl_c)
            raise KeyboardInterrupt
    del discarded
    with act:
        y = (w * 2).sin()  # saves a tensor of the same size
    gpu.run_all()  # (the fixture's check: no copy ran on a block handed out again)
    y.sum().backward()
    assert torch.allclose(w.grad, 2 * torch.cos(2 * w), rtol=0, atol=1e-6)
    del y
    assert all_back(pool)
    act.close()
