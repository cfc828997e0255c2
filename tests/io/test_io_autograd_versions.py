"""Reads into a tensor autograd may have saved: a read of new bytes is a change in place and is told to autograd as
torch's copy_ tells it (a backward through a graph that saved the old values raises); a swapped-out tensor read back
holds the bytes autograd saved and keeps its version, so that graph still runs. Reference: torch's own copy_ and the
resident graph's gradients."""
import pytest
import torch

import swapio
from conftest import TIMEOUT

STALE = "modified by an inplace operation"


@pytest.fixture
def store(tmp_path):
    s = swapio.SwapStore(tmp_path / "swap")
    yield s
    s.close()


def saving(t):
    """A graph that saves t (x * t saves t for x's gradient), and x."""
    x = torch.ones(t.shape, requires_grad=True)
    return (x * t).sum(), x


def test_pread_moves_the_version_as_copy_does(tmp_path):
    with swapio.AioHandle() as h:
        h.pwrite(torch.arange(1024, dtype=torch.float32), tmp_path / "f").wait()
        for fill in (lambda t: t.copy_(torch.ones(1024)), lambda t: h.pread(t, tmp_path / "f").wait()):
            t = torch.zeros(1024)
            loss, _ = saving(t)
            fill(t)
            with pytest.raises(RuntimeError, match=STALE):
                loss.backward()
        # a view's read moves the counter it shares with its base
        base = torch.zeros(2048)
        loss, _ = saving(base)
        h.pread(base[1024:], tmp_path / "f").wait()
        with pytest.raises(RuntimeError, match=STALE):
            loss.backward()


def test_pread_restores_keeps_the_version_and_the_graph_runs(tmp_path):
    with swapio.AioHandle() as h:
        t = torch.arange(1024, dtype=torch.float32)
        h.pwrite(t, tmp_path / "f").wait()
        loss, x = saving(t)
        h.pread(t, tmp_path / "f", restores=True).wait()
        loss.backward()
        assert torch.equal(x.grad, torch.arange(1024, dtype=torch.float32))
        with pytest.raises(TypeError, match="restores"):
            h.pread(t, tmp_path / "f", restores=1)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_swap_in_out_moves_the_version_as_copy_does(store, layout):
    src = torch.randn(64, 32)
    swapped = store.swap_out(src, name="w", release=False)
    swapped.wait(timeout=TIMEOUT)
    out = torch.zeros(64, 32) if layout == "contiguous" else torch.zeros(32, 64).t()
    loss, _ = saving(out)
    swapped.swap_in(out=out).wait(timeout=TIMEOUT)
    assert torch.equal(out, src)
    with pytest.raises(RuntimeError, match=STALE):
        loss.backward()


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_a_refilled_tensor_keeps_its_version_so_a_graph_that_saved_it_runs(store, layout):
    """Swapping out what a graph saved, then back before backward, is the point of swapping: the gradient equals
    the resident graph's (a strided source was refilled through a copy_ that moved the counter: backward raised)."""
    w = torch.randn(64, 32) if layout == "contiguous" else torch.randn(32, 64).t()
    x = torch.randn(64, 32, requires_grad=True)
    expected = w.clone()
    loss = (x * w).sum()
    version = w._version
    store.swap_out(w, name="w").wait(timeout=TIMEOUT)
    assert w.untyped_storage().nbytes() == 0
    store["w"].swap_in().wait(timeout=TIMEOUT)
    assert w._version == version and torch.equal(w, expected)
    loss.backward()
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_an_inference_tensor_is_refilled_outside_inference_mode(store, layout):
    """A tensor made under torch.inference_mode(), swapped out and refilled after it: the refill puts its bytes back
    in every route (a strided one was refilled by a copy_ that torch refuses on an inference tensor outside
    inference mode: the read failed and the tensor stayed released). Reference: the tensor before the swap-out."""
    with torch.inference_mode():
        w = torch.randn(64, 32) if layout == "contiguous" else torch.randn(32, 64).t()
    expected = w.clone()
    store.swap_out(w, name="w").wait(timeout=TIMEOUT)
    assert w.untyped_storage().nbytes() == 0
    store["w"].swap_in().wait(timeout=TIMEOUT)
    assert w.is_inference() and torch.equal(w, expected)
