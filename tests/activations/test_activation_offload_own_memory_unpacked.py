"""A CPU tensor unpacked while the offload still held its own memory (torchviz-style `grad_fn._saved_self` in the
forward, a first backward with retain_graph) and changed in place once that memory was let go: the next unpack
must read back what was saved (as documented for a change after the write was seen finished), not hand out the
changed memory. Before the fix the changed tensor came back and the gradient was silently wrong."""
import torch

from helpers.activations import settle, swap_files
from swapio.offload import offload_activations

N = 256  # 256 KiB a saved storage


def leaf():
    return torch.randn(N, N, generator=torch.Generator().manual_seed(0)).requires_grad_(True)


def grad_as_saved():
    """The gradient of sin(x * 2).sum(), computed on the values as saved (before the change in place)."""
    x = leaf()
    (x * 2).sin().sum().backward()
    return x.grad


def test_a_tensor_unpacked_in_the_forward_then_changed_comes_back_as_saved(tmp_path):
    x = leaf()
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    h = x * 2
    with act:
        y = h.sin()
        peeked = y.grad_fn._saved_self  # what torchviz's show_saved reads: an unpack during the forward
        assert torch.equal(peeked, h)
        del peeked
        settle(act)  # h's write is seen finished: a change from now on leaves the saved bytes as they were
        other = (x * 3).exp()  # the next save lets h's own memory go (no staging room)
    h.add_(1)
    y.sum().backward()
    assert torch.equal(x.grad, grad_as_saved())
    del y, other
    assert swap_files(act.directory) == []
    act.close()


def test_a_tensor_read_from_ram_by_a_retained_backward_then_changed_comes_back_as_saved(tmp_path):
    x = leaf()
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=300 << 10)
    h = x * 2
    with act:  # a `with` around the loop, backwards included
        y = h.sin()
        settle(act)
        y.sum().backward(retain_graph=True)  # h came back from RAM: its own memory
        first, x.grad = x.grad, None
        (x * 3).exp()  # no room for both: h's own memory goes
        h.add_(1)
        y.sum().backward()
    want = grad_as_saved()
    assert torch.equal(first, want) and torch.equal(x.grad, want)
    del y
    assert swap_files(act.directory) == []
    act.close()
