"""Higher-order gradients and partial backwards through offloaded activations: a gradient penalty
(create_graph=True) with the first backward inside or outside the `with`, third derivatives, a graph backed through
only in part; each gradient bit-equal to the run without offload, and each swap file gone with its graph."""
import contextlib
import gc

import pytest
import torch

from helpers.activations import swap_files
from swapio.offload import offload_activations


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))


def _nvme(tmp_path):
    return offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)  # all read back


def _gradient_penalty(model, x, act, first_grad_inside):
    params = list(model.parameters())
    with act if act is not None else contextlib.nullcontext():
        loss = model(x).square().sum()
        if first_grad_inside:  # the double-backward graph's own saves go to the offload too
            grads = torch.autograd.grad(loss, [x, *params], create_graph=True)
    if not first_grad_inside:
        grads = torch.autograd.grad(loss, [x, *params], create_graph=True)
    penalty = sum(g.square().sum() for g in grads)
    return torch.autograd.grad(penalty, [x, *params])


@pytest.mark.parametrize("first_grad_inside", [True, False], ids=["inside", "outside"])
def test_gradient_penalty_bit_equal_and_files_go(tmp_path, first_grad_inside):
    model, x = _model(), torch.randn(16, 64, requires_grad=True)
    want = _gradient_penalty(model, x, None, first_grad_inside)
    act = _nvme(tmp_path)
    got = _gradient_penalty(model, x, act, first_grad_inside)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    gc.collect()
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()


def test_third_derivative_bit_equal(tmp_path):
    model, x = _model(), torch.randn(8, 64, requires_grad=True)

    def run(act):
        with act if act is not None else contextlib.nullcontext():
            y = model(x).pow(3).sum()
            g, = torch.autograd.grad(y, x, create_graph=True)
            g2, = torch.autograd.grad(g.sum(), x, create_graph=True)
        g3, = torch.autograd.grad(g2.sum(), x)
        return g, g2, g3
    want = run(None)
    act = _nvme(tmp_path)
    for g, w in zip(run(act), want):
        assert torch.equal(g, w)
    act.close()


def test_a_create_graph_graph_dropped_without_its_backward_frees_its_file(tmp_path):
    model, x = _model(), torch.randn(16, 64, requires_grad=True)
    act = _nvme(tmp_path)
    with act:
        loss = model(x).square().sum()
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    del loss
    assert swap_files(act.directory) != []  # the gradients' graph still needs what the forward saved
    del grads
    gc.collect()
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()


def test_backward_through_one_head_keeps_the_other_heads_activations(tmp_path):
    model, x = _model(), torch.randn(16, 64, requires_grad=True)

    def heads(act):
        with act if act is not None else contextlib.nullcontext():
            h = model[1](model[0](x))
            return h, model[2](h).square().sum(), (h * 3).exp().sum()
    w_h, w_a, w_b = heads(None)
    want = (torch.autograd.grad(w_a, x)[0], torch.autograd.grad(w_b, w_h)[0])
    act = _nvme(tmp_path)
    h, a, b = heads(act)
    assert torch.equal(torch.autograd.grad(a, x)[0], want[0])
    assert swap_files(act.directory) != []  # b's own nodes (the mul and the exp) still hold what they saved
    assert torch.equal(torch.autograd.grad(b, h)[0], want[1])
    del h, a, b
    gc.collect()
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()


def test_a_training_loop_in_one_with_mixing_retained_penalised_and_leftover_graphs(tmp_path):
    model = _model()
    xs = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def loop(ctx):
        model.zero_grad(set_to_none=True)
        out, leftover = [], None
        with ctx:
            for i, x in enumerate(xs):
                loss = model(x).tanh().square().sum()
                if i % 2 == 0:
                    loss.backward(retain_graph=True)
                    loss.backward()
                else:
                    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
                    (loss + sum(g.square().sum() for g in grads)).backward()
                if leftover is not None:
                    leftover.backward()  # the previous step's graph, backed through after this step's forward
                leftover = model(x * 2).exp().sum()
                out += [p.grad.clone() for p in model.parameters()]
            leftover.backward()
        return out + [p.grad.clone() for p in model.parameters()]
    want = loop(contextlib.nullcontext())
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=4096)
    for g, w in zip(loop(act), want):
        assert torch.equal(g, w)
    gc.collect()
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()
