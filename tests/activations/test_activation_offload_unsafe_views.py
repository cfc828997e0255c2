"""Tensors that share a storage without sharing a version counter (torch.unsafe_chunk / unsafe_split, which the
CPU GRU uses for its gates): each is changed in place on its own, so one saved copy of the storage cannot serve
both. Gradients must stay bit-equal to the run without offload."""
import torch

from swapio.offload import offload_activations


def _unsafe_chunks_loss(a, w):
    g = a * 1                       # one storage, split below into tensors with their own version counters
    c0, c1 = g.unsafe_chunk(2, 1)
    r0 = c0.sigmoid_()              # c0 at version 1, saved (sigmoid_ saves its result)
    y0 = r0 * w                     # saved again at version 1
    e = y0.exp()                    # a later save: (staging_bytes=0) waits for c0's write, then c0 is on disk only
    r1 = c1.sigmoid_()              # changes the storage's second half: c0's counter does not move
    y1 = r1 * w                     # c1, also at version 1: not the bytes saved for c0
    return (e * y1).sum()


def _grads(loss_fn, inputs, act=None):
    if act is None:
        return torch.autograd.grad(loss_fn(*inputs), inputs)
    with act:
        loss = loss_fn(*inputs)
    return torch.autograd.grad(loss, inputs)


def test_unsafe_chunks_of_one_storage_each_come_back_as_saved(tmp_path):
    torch.manual_seed(0)
    inputs = (torch.randn(4, 6, requires_grad=True), torch.randn(4, 3, requires_grad=True))
    want = _grads(_unsafe_chunks_loss, inputs)
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)  # all read back
    got = _grads(_unsafe_chunks_loss, inputs, act)
    act.close()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_gru_gradients_bit_equal_to_no_offload(tmp_path):
    torch.manual_seed(0)
    gru = torch.nn.GRU(16, 24, num_layers=2, batch_first=True)
    x = torch.randn(3, 7, 16, requires_grad=True)
    inputs = (x, *gru.parameters())

    def loss(x, *_):
        return gru(x)[0].square().sum()

    want = _grads(loss, inputs)
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    got = _grads(loss, inputs, act)
    assert act.stats()["tensors"] > 0
    assert act.stats()["shared_views"] > 0  # a piece saved twice, the other piece saved between: one copy
    act.close()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
