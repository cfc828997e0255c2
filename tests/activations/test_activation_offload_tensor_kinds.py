"""Saved tensors that offload_activations leaves in place: nested tensors (strided and jagged) come back as they
were saved, their gradients bit-equal to the run without offload."""
import warnings

import pytest
import torch

from swapio.offload import offload_activations


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_left_in_place_and_gradients_stay_equal(tmp_path, layout):
    def loss(parts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # nested tensors' "prototype stage" warning
            nested = torch.nested.as_nested_tensor(parts, layout=layout)
        y = (nested * 2).sin() * nested
        return torch.cat([t.reshape(-1) for t in y.unbind()]).sum()

    parts = [torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)]
    want = torch.autograd.grad(loss(parts), parts)
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0)
    with act:
        got = loss(parts)
    for g, w in zip(torch.autograd.grad(got, parts), want):
        assert torch.equal(g, w)
    act.close()


def _odd_views(a, *_):
    b = a * 1
    overlapping = torch.as_strided(b, (4, 4), (2, 1), 1)  # rows overlap in memory
    expanded = b[:1].expand(5, 8)                          # stride 0
    tail = b[1:].reshape(-1)[3:]                           # a storage offset
    return ((b.t().sin() * b.t()).sum() + (b[:, ::2] * b[:, ::2].exp()).sum() + (tail * tail).sum()
            + (expanded * expanded.cos()).sum() + (overlapping * overlapping.tanh()).sum())


def _complex(a, *_):
    z = torch.complex(a, a.flip(0))
    return (z * z.exp()).abs().sum() + torch.view_as_real(z * z).sum()


def _integer_and_bool_saves(a, w, *_):
    idx = torch.arange(30) % 50
    e = torch.nn.functional.embedding(idx, w)
    picked = torch.gather(e, 1, (torch.arange(90) % 8).reshape(30, 3))
    dropped = torch.nn.functional.dropout(e, 0.5, training=True)        # a bool mask
    pooled = torch.zeros(50, 8).index_add(0, idx, e * 2)
    return (picked.sum() + e.masked_fill(e > 0.5, 0.0).square().sum() + dropped.square().sum()
            + e[e > 0].exp().sum() + (w[:0] * 2).sum() + (pooled * pooled).sum() + (a * 0).sum())


def _low_precision_and_layouts(a, *_):
    img = a.reshape(1, 3, 4, 4)[:, :, :, :].repeat(2, 1, 1, 1).contiguous(memory_format=torch.channels_last)
    pooled = torch.nn.functional.max_pool2d(img.relu(), 2)
    return (pooled.square().sum() + (a.bfloat16().exp() * a.bfloat16()).float().sum()
            + (a * a.to(torch.float8_e4m3fn).float()).sum() + (a.half().sigmoid()).float().sum())


class _SaveAliases(torch.autograd.Function):
    """Saves a tensor with a detach() and a dtype view of it: aliases on its version counter."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h, h.detach(), h.view(torch.int32))
        return h.square()

    @staticmethod
    def backward(ctx, g):
        h, detached, bits = ctx.saved_tensors
        assert torch.equal(bits, h.view(torch.int32))
        return g * (h + detached)


def _aliases(a, *_):
    return _SaveAliases.apply(a * 2).sum()


@pytest.mark.parametrize("loss_fn", [_odd_views, _complex, _integer_and_bool_saves, _low_precision_and_layouts,
                                     _aliases], ids=lambda f: f.__name__.strip("_"))
def test_odd_saved_tensors_read_back_from_the_disk_stay_bit_equal(tmp_path, loss_fn):
    a = torch.randn(6, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    w = torch.randn(50, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def grads(act):
        torch.manual_seed(7)  # dropout
        if act is None:
            return torch.autograd.grad(loss_fn(a, w), (a, w), allow_unused=True, materialize_grads=True)
        with act:
            loss = loss_fn(a, w)
        return torch.autograd.grad(loss, (a, w), allow_unused=True, materialize_grads=True)
    want = grads(None)
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)  # all read back
    got = grads(act)
    assert act.stats()["tensors"] > 0
    for g, w_ in zip(got, want):
        assert torch.equal(g, w_)
    if loss_fn is _aliases:
        assert act.stats()["shared_views"] >= 2  # detach() and the dtype view share h's one copy
    act.close()
