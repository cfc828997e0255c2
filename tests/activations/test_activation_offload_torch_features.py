"""Torch features inside offload_activations' `with` (to="nvme", everything read back from the disk): vmap,
attention, recurrent layers (packed sequences too), checkpointed functions with the `with` inside them; gradients
bit-equal to the run without offload. torch.func's gradient transforms refuse saved-tensor hooks: torch's error,
and the offload leaves nothing behind."""
import contextlib
import shutil

import pytest
import torch

from helpers.activations import hooks_installed, swap_files
from swapio.offload import offload_activations


def _nvme(tmp_path):
    return offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)


def _assert_offloaded_grads_equal(tmp_path, loss_fn, inputs):
    want = torch.autograd.grad(loss_fn(), inputs)
    act = _nvme(tmp_path)
    with act:
        loss = loss_fn()
    got = torch.autograd.grad(loss, inputs)
    assert act.stats()["tensors"] > 0 and act.stats()["read_bytes"] > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    del loss
    assert swap_files(act.directory) == []
    act.close()


def test_vmap(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16, requires_grad=True)
    _assert_offloaded_grads_equal(tmp_path, lambda: torch.vmap(lambda r: model(r).sin())(x).sum(),
                                  [x, *model.parameters()])


def test_multihead_attention_and_scaled_dot_product_attention(tmp_path):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    q = torch.randn(2, 10, 32, requires_grad=True)

    def loss():
        out, weights = mha(q, q, q, need_weights=True)
        heads = q.view(2, 10, 4, 8).transpose(1, 2)
        causal = torch.nn.functional.scaled_dot_product_attention(heads, heads * 2, heads.tanh(), is_causal=True)
        return out.square().sum() + weights.sum() + causal.square().sum()
    _assert_offloaded_grads_equal(tmp_path, loss, [q, *mha.parameters()])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_lstm_and_gru(tmp_path, packed):
    torch.manual_seed(0)
    lstm, gru = torch.nn.LSTM(16, 24, num_layers=2, batch_first=True), torch.nn.GRU(16, 24, batch_first=True)
    x = torch.randn(3, 7, 16, requires_grad=True)

    def loss():
        seq = torch.nn.utils.rnn.pack_padded_sequence(x, [7, 5, 2], batch_first=True) if packed else x
        (out, (h, c)), (out2, _) = lstm(seq), gru(seq)
        if packed:
            out, out2 = out.data, out2.data
        return out.square().sum() + h.sum() + c.sum() + out2.square().sum()
    _assert_offloaded_grads_equal(tmp_path, loss, [x, *lstm.parameters(), *gru.parameters()])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_with_inside_a_checkpointed_function(tmp_path, reentrant):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)

    def run(ctx):
        def segment(t):
            with ctx:  # the recomputation in backward enters it again
                return model(t).sin()
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.utils.checkpoint.checkpoint(segment, x, use_reentrant=reentrant).square().sum().backward()
        return [t.grad.clone() for t in (x, *model.parameters())]  # (reentrant: no autograd.grad)
    want = run(contextlib.nullcontext())
    act = _nvme(tmp_path)
    for g, w in zip(run(act), want):
        assert torch.equal(g, w)
    assert act.stats()["tensors"] > 0
    assert not hooks_installed() and swap_files(act.directory) == []
    act.close()


def test_torch_func_gradient_transforms_refuse_the_hooks_and_nothing_is_left(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    act = _nvme(tmp_path)
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        with act:
            saved = model(x).tanh().sum()  # a forward before it: discarded with the block
            torch.func.grad(lambda t: model(t).sum())(x)
    assert not hooks_installed() and swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    with pytest.raises(RuntimeError, match="discarded"):
        saved.backward()
    want = torch.autograd.grad(model(x).tanh().sum(), x)[0]
    with act:
        loss = model(x).tanh().sum()
    assert torch.equal(torch.autograd.grad(loss, x)[0], want)
    act.close()


@pytest.mark.slow  # (inductor builds C++)
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_compiled_model_bit_equal_to_its_compiled_run_without_offload(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64),
                                torch.nn.LayerNorm(64))
    x = torch.randn(32, 64, requires_grad=True)
    compiled = torch.compile(model)  # inductor: its own kernels, the saved tensors through the hooks
    want = torch.autograd.grad(compiled(x).square().sum(), [x, *model.parameters()])
    act = _nvme(tmp_path)
    with act:
        loss = compiled(x).square().sum()
    got = torch.autograd.grad(loss, [x, *model.parameters()])
    assert act.stats()["tensors"] > 0 and act.stats()["read_bytes"] > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    act.close()
