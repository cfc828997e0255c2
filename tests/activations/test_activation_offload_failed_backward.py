"""A backward that fails in one of the offload's unpacks (a saved tensor changed in place, a read's OSError). Once
an exception came out of an unpack hook (any hook's, not only swapio's), torch never frees what the nodes it had
not run yet saved, even after the graph is dropped: the forward's swap file and memory stayed until close(),
step after step for a loop that catches the error and goes on. They now go as the backward fails; a second try
raises, and a `with` still open goes on with a fresh session."""
import gc
from contextlib import nullcontext

import pytest
import torch

from helpers.activations import GatedWrites, swap_files
from swapio.offload import offload_activations

N = 256  # 256 KiB a saved storage


def leaf():
    return torch.randn(N, N, generator=torch.Generator().manual_seed(0)).requires_grad_(True)


def forward(x):
    """(the tensor `sin` saves, the loss): each op saves a storage of its own."""
    h = x * 2
    return h, h.sin().exp().tanh().sum()


def reference_grad():
    x = leaf()
    forward(x)[1].backward()
    return x.grad


def left_behind(act):
    gc.collect()
    return swap_files(act.directory), act.stats()["live_sessions"], act.stats()["pinned_bytes"]


def test_a_saved_tensor_changed_while_written_fails_the_backward_and_leaves_nothing(tmp_path, monkeypatch):
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=64 << 20)
    writes = GatedWrites(act, monkeypatch, hold_waits=False)
    x = leaf()
    with act:
        h, loss = forward(x)
    h.add_(1)  # its write not yet seen finished: the backward refuses it
    writes.release()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert left_behind(act) == ([], 0, 0)
    with pytest.raises(RuntimeError, match="discarded|a second time"):  # (as the nodes that ran before it)
        loss.backward()
    del h, loss
    x = leaf()
    with act:  # and the next step is as without offload
        loss = forward(x)[1]
    loss.backward()
    assert torch.equal(x.grad, reference_grad())
    del loss
    assert left_behind(act) == ([], 0, 0)
    act.close()


def backward_with_failing_reads(act, loss, monkeypatch):
    """loss.backward() while every read back from the swap file fails with EIO: the backward raises it."""
    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")
    with monkeypatch.context() as patch, pytest.raises(OSError, match="Input/output error"):
        patch.setattr(act._res.handle, "pread", failing)
        loss.backward()


def test_a_read_that_fails_in_the_backward_leaves_nothing(tmp_path, monkeypatch):
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    with act:
        loss = forward(leaf())[1]
    backward_with_failing_reads(act, loss, monkeypatch)
    assert left_behind(act) == ([], 0, 0)
    del loss
    act.close()


def ctrl_c_after_abort(act, patch):
    """A Ctrl-C raised by a session's abort() once it cleaned up (what it does with one that lands inside it)."""
    session_type = type(next(iter(act._res.sessions)))
    abort = session_type.abort

    def abort_then_ctrl_c(self):
        abort(self)
        raise KeyboardInterrupt
    patch.setattr(session_type, "abort", abort_then_ctrl_c)


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["failed", "ctrl_c_in_its_discard"])
def test_a_with_around_the_loop_goes_on_after_a_backward_failed_in_it(tmp_path, monkeypatch, ctrl_c):
    # with ctrl_c: the `with` kept the discarded session, and every later forward in it failed
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    with act:
        loss = forward(leaf())[1]
        with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt) if ctrl_c else nullcontext():
            if ctrl_c:
                ctrl_c_after_abort(act, patch)
            backward_with_failing_reads(act, loss, monkeypatch)
        del loss
        assert left_behind(act)[0] == []
        x = leaf()
        loss = forward(x)[1]  # saved into the block's fresh session
        loss.backward()
        assert torch.equal(x.grad, reference_grad())
        del loss
    assert left_behind(act) == ([], 0, 0)
    act.close()


def test_a_tensor_left_in_place_and_changed_fails_the_backward_and_the_offloaded_ones_go(tmp_path):
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=1 << 20, staging_bytes=0)
    x = leaf()
    with act:
        big = torch.randn(512, 1024) * x.sum()  # 2 MiB: offloaded
        loss = big.cos().sum()
        small = x[:8] * 2  # under min_bytes: left where it is; its node runs first in the backward
        loss = loss + small.sin().sum()
    assert swap_files(act.directory) != []
    small.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert left_behind(act) == ([], 0, 0)
    del loss
    act.close()

