"""offload_activations' hooks against the user's own contexts: a `with` block that ends while hooks pushed inside
it are still in place, and close() inside the block, fail loudly instead of saving into an ended forward."""
import pytest
import torch

from helpers.activations import hooks_installed
from swapio.offload import offload_activations


def nvme(tmp_path, **kw):
    return offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, **kw)


def _saves(x):
    return (x.exp() * x).sin().sum()


def test_a_block_ended_under_hooks_still_pushed_in_it_fails_loudly_and_its_hooks_save_nothing_later(tmp_path):
    act, x = nvme(tmp_path), torch.randn(64, requires_grad=True)
    want = torch.autograd.grad(_saves(x), x)[0]
    user = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    act.__enter__()
    user.__enter__()
    before = _saves(x)  # saved through the user's hooks (on top)
    with pytest.raises(RuntimeError, match="still pushed"):
        act.__exit__(None, None, None)  # out of order: the user's hooks are on top of ours
    user.__exit__(None, None, None)  # ours are on top again, their forward ended
    try:
        with pytest.raises(RuntimeError, match="ended"):
            _saves(x)
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    assert not hooks_installed()
    assert torch.equal(torch.autograd.grad(before, x)[0], want)
    with act:  # the object is still usable
        loss = _saves(x)
    assert torch.equal(torch.autograd.grad(loss, x)[0], want)
    act.close()


def test_close_inside_the_block_makes_a_later_save_fail_clearly(tmp_path):
    act, x = nvme(tmp_path), torch.randn(64, requires_grad=True)
    with pytest.raises(RuntimeError, match="closed"):
        with act:
            y = x.exp() * x
            act.close()
            y.sin().sum()
    assert not hooks_installed()
