"""Activation offload with the rest of a training setup: a transformers GPT-2 with gradient checkpointing, the
model-level switch, and training offloaded weights (disk_offload + OffloadAdamW) in the same step."""
import os

import pytest
import torch

from helpers.activations import assert_same_grads, batch, grads_of, hooks_installed, make_stack, swap_files
from helpers.offload_training import MLP, batches, build_opt, make_model, offload, resident_run, train, weights
from swapio.offload import activation_store, disable_activation_offload, enable_activation_offload, \
    offload_activations

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64,
                                     attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    return transformers.GPT2LMHeadModel(config).train()


class LossOf(torch.nn.Module):
    """model(ids).loss as a module whose parameters are the model's (for grads_of)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        ids = (x.detach().abs() * 1000).long() % 64
        return self.model(input_ids=ids[..., 0], labels=ids[..., 0]).loss * x.sum() / x.sum().detach()


def spy(monkeypatch):
    seen = []
    real = activation_store.Session._offload

    def counting(self, tensor, storage, *rest):
        seen.append(storage.nbytes())
        return real(self, tensor, storage, *rest)
    monkeypatch.setattr(activation_store.Session, "_offload", counting)
    return seen


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_gpt2_gradients_bit_equal_with_and_without_gradient_checkpointing(tmp_path, monkeypatch, checkpointing):
    model = gpt2()
    if checkpointing:
        model.gradient_checkpointing_enable()
    wrapped, x = LossOf(model), torch.randn(2, 24, 1, generator=torch.Generator().manual_seed(3))
    want = grads_of(wrapped, x)
    seen = spy(monkeypatch)
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=1 << 12)
    assert_same_grads(grads_of(wrapped, x, act), want)
    assert seen and not hooks_installed() and swap_files(act.directory) == []


def test_model_switch_offloads_every_training_forward_and_switches_off(tmp_path, monkeypatch):
    model = gpt2()
    wrapped, x = LossOf(model), torch.randn(2, 24, 1, generator=torch.Generator().manual_seed(3))
    want = grads_of(wrapped, x)
    seen = spy(monkeypatch)
    act = enable_activation_offload(model, to="nvme", swap_dir=tmp_path, min_bytes=0)
    with pytest.raises(RuntimeError, match="already enabled"):
        enable_activation_offload(model, to="nvme", swap_dir=tmp_path)
    assert_same_grads(grads_of(wrapped, x), want)  # no `with` here: the model's forward enters it
    assert seen
    seen.clear()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert seen == []  # nothing is saved without grad
    directory = act.directory
    disable_activation_offload(model)
    assert "forward" not in model.__dict__ and not os.path.exists(directory)
    assert_same_grads(grads_of(wrapped, x), want)
    assert seen == []


def saved_activation_storages(model, batch):
    """How many distinct storages other than parameters a resident model's forward saves for backward (the loss,
    computed outside the forward, is not the model switch's)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = set()

    def pack(t):
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter) and t.untyped_storage().data_ptr() not in params:
            storages.add(t.untyped_storage().data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch[0])
    return len(storages)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_training_offloaded_weights_with_offloaded_activations_in_one_step(tmp_path, monkeypatch, storage):
    """Both in one step: the offloaded modules' weights are saved as tokens by weight offload, the rest of what
    they save goes to activation offload; training gives the resident run's losses and weights bit for bit."""
    data = batches(MLP, 3)
    want_losses, want_weights = resident_run(MLP, torch.float32, "AdamW", data, tmp_path / "ref",
                                             opt_kw=dict(offload="nvme"))
    model = offload(make_model(), storage, tmp_path)
    seen = spy(monkeypatch)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "opt", offload="nvme")
    act_dir = tmp_path / "act"
    act_dir.mkdir()
    act = enable_activation_offload(model, to="nvme", swap_dir=act_dir, min_bytes=0, staging_bytes=0)
    losses = train(model, opt, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    disable_activation_offload(model)
    from swapio.offload import remove_offload
    remove_offload(model)
    got = weights(model)
    assert all(torch.equal(got[n], want_weights[n]) for n in want_weights)
    # every storage the resident model saves, parameters aside, was offloaded: also those saved inside the
    # offloaded modules, where weight offload's hooks are on top
    assert len(seen) == len(data) * saved_activation_storages(make_model(), data[0])
    assert not hooks_installed()
    opt.close() if hasattr(opt, "close") else None


@pytest.mark.parametrize("to", ["cpu", "nvme"])
def test_a_compiled_model_offloads_what_its_graph_saves_and_computes_the_same(tmp_path, to):
    """torch.compile's autograd saves its graph's tensors through the saved-tensor hooks too: with to="nvme" they
    go to the disk, and the gradients equal the compiled run's without offload, bit for bit."""
    model, x = make_stack(), batch()
    compiled = torch.compile(model, backend="aot_eager")  # (autograd as inductor's; no C++ build)

    def grads(ctx=None):
        model.zero_grad()
        torch.manual_seed(123)  # (the same dropout masks)
        with ctx if ctx is not None else torch.enable_grad():
            y = compiled(x)
        y.sum().backward()  # (the sum saves nothing: what is offloaded is the compiled graph's)
        return [p.grad.clone() for p in model.parameters()]
    want = grads()
    act = offload_activations(to=to, min_bytes=0, **(dict(swap_dir=tmp_path) if to == "nvme" else {}))
    got = grads(act)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (act.stats()["tensors"] > 0) == (to == "nvme")  # (to="cpu" moves only CUDA tensors)
    act.close()
    assert swap_files(tmp_path) == []


def compiled_reference_grads(model, x):
    """The gradients of torch.compile(model) without offload (a compiled model of its own, so that the one under
    test starts uncompiled)."""
    model.zero_grad()
    torch.compile(model, backend="aot_eager")(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def test_a_with_block_inside_a_compiled_function_takes_its_hooks_off(tmp_path):
    """dynamo ran the offload's bookkeeping as compiled frames: the hooks stayed pushed after each `with` (every
    later saved tensor of the program went to a finished forward's session). It runs eagerly now."""
    model, x = make_stack(depth=1), batch()
    model.eval()  # (no dropout: the reference draws no random numbers either)
    want = compiled_reference_grads(model, x)
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)

    def forward(x):
        with act:
            return model(x)
    step = torch.compile(forward, backend="aot_eager")
    for _ in range(2):
        model.zero_grad()
        step(x).square().sum().backward()
        assert not hooks_installed()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
    assert act.stats()["tensors"] > 0 and act.stats()["live_sessions"] == 0
    act.close()
    assert swap_files(tmp_path) == []


def test_compiling_a_model_with_the_switch_on_offloads_each_forward_and_switches_off(tmp_path):
    """enable_activation_offload, then torch.compile(model) (Trainer's torch_compile=True): each forward in the
    offload and out of it again; after disable_activation_offload nothing is offloaded any more."""
    model, x = make_stack(depth=1), batch()
    model.eval()
    want = compiled_reference_grads(model, x)
    act = enable_activation_offload(model, to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    from torch._dynamo.backends.debugging import aot_eager
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or aot_eager(gm, inputs))
    for _ in range(2):
        model.zero_grad()
        compiled(x).square().sum().backward()
        assert not hooks_installed()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
    offloaded = act.stats()["tensors"]
    assert offloaded > 0 and len(graphs) == 1  # the model's forward compiled, the switch around it ran eagerly
    disable_activation_offload(model)
    model.zero_grad()
    compiled(x).square().sum().backward()  # (the closed offload's hooks were still pushed: FileNotFoundError)
    assert act.stats()["tensors"] == offloaded and not hooks_installed()
