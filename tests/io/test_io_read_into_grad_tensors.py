"""pread into a tensor autograd tracks follows torch's rules for an in-place copy_: a leaf that requires grad (or a
view of one) and an inference tensor outside inference mode are refused with torch's RuntimeError; a non-leaf that
requires grad is refused too (copy_ would record itself in the graph, which a native read cannot, so the gradient
would flow to the overwritten computation). SwapStore's swap_in(out=...) follows the same rules. Reference: torch's own copy_ and the gradient of its graph."""
import pytest
import torch

import swapio


@pytest.fixture
def handle_and_file(tmp_path):
    with swapio.AioHandle() as h:
        h.pwrite(torch.arange(8.0), tmp_path / "f").wait()
        yield h, tmp_path / "f"


def _leaf():
    return torch.zeros(8, requires_grad=True)


def _view_of_leaf():
    return torch.zeros(16, requires_grad=True)[8:]


@pytest.mark.parametrize("make", [_leaf, _view_of_leaf], ids=["leaf", "view-of-leaf"])
def test_a_leaf_that_requires_grad_is_refused_as_copy_refuses_it(handle_and_file, make):
    h, path = handle_and_file
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        make().copy_(torch.ones(8))  # the reference
    t = make()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        h.pread(t, path)
    assert torch.equal(t.detach(), torch.zeros(8))
    with torch.no_grad():  # allowed there, as copy_ is
        h.pread(t, path).wait()
    assert torch.equal(t.detach(), torch.arange(8.0))


def test_a_non_leaf_that_requires_grad_is_refused_not_given_wrong_gradients(handle_and_file):
    h, path = handle_and_file
    x = torch.ones(8, requires_grad=True)
    y = x * 2
    with pytest.raises(RuntimeError, match="requires grad"):
        h.pread(y, path)
    # reference: after copy_ of constants, y's values no longer depend on x: its gradient is zero
    y.copy_(torch.arange(8.0))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(8))


def test_an_inference_tensor_outside_inference_mode_is_refused_as_copy_refuses_it(handle_and_file):
    h, path = handle_and_file
    with torch.inference_mode():
        reference, t = torch.zeros(8), torch.zeros(8)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        reference.copy_(torch.ones(8))
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        h.pread(t, path)
    assert torch.equal(t, torch.zeros(8))
    with torch.inference_mode():
        h.pread(t, path).wait()
    assert torch.equal(t, torch.arange(8.0))


@pytest.mark.parametrize("make", [_leaf, lambda: torch.ones(8, requires_grad=True) * 2], ids=["leaf", "non-leaf"])
def test_swap_in_out_follows_the_same_rules(tmp_path, make):
    with swapio.SwapStore(tmp_path / "swap") as store:
        swapped = store.swap_out(torch.arange(8.0), name="w", release=False).wait()
        out = make()
        before = out.detach().clone()
        with pytest.raises(RuntimeError, match="requires grad"):
            swapped.swap_in(out=out)
        assert torch.equal(out.detach(), before)
        with torch.no_grad():
            swapped.swap_in(out=out).wait()
        assert torch.equal(out.detach(), torch.arange(8.0))
        with torch.inference_mode():
            inference = torch.zeros(8)
        with pytest.raises(RuntimeError, match="[Ii]nference"):
            swapped.swap_in(out=inference)
