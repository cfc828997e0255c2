"""A backward that changes a saved tensor in place (a custom Function reusing its saved input's memory for the
gradient), while another node saved the same tensor: autograd refuses the later node's unpack without offload.
With offload, where that storage is read back once for both nodes (or found still in RAM), the later node must
not compute with the changed bytes: the same RuntimeError."""
import pytest
import torch

from swapio.offload import offload_activations


class ReusesSavedMemory(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * 2

    @staticmethod
    def backward(ctx, g):
        a, = ctx.saved_tensors
        return a.mul_(g)  # the gradient written over the saved tensor


def _loss(x):
    h = x.exp()  # exp saves h; the Function and the square save it too
    return ReusesSavedMemory.apply(h).sum() + (h * h).sum()


@pytest.mark.parametrize("staging_bytes", [0, 1 << 30], ids=["read-back", "kept-in-ram"])
def test_a_saved_tensor_changed_in_place_by_the_backward_raises_as_without_offload(tmp_path, staging_bytes):
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(_loss(x), x)  # the reference: torch refuses it
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=staging_bytes)
    with act:
        loss = _loss(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, x)
    act.close()
