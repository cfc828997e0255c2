"""torch.compile of an offloaded model: each offloaded module runs eagerly (the graph breaks around it, the code
between compiles), so outputs and training equal the offloaded model run eagerly and the resident model. Before,
dynamo traced swapio's weight swapping: "mat1 and mat2 shapes cannot be multiplied (5x16 and 4x16)" for an MLP
with no such layer, and compiling put NaN stand-ins where the optimizer looks for the weights' placeholders.
Backends "eager" and "aot_eager" (aot_eager runs AOTAutograd's graphs, forward and backward): no C++ compile."""
import pytest
import torch

from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt,
                                      loss_of, make_model, offload, one_thread, resident_run, train, weights)
from swapio.offload import remove_offload

pytest.importorskip("safetensors")
BACKENDS = ["eager", "aot_eager"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", ["disk", "ckpt", "cpu"])
def test_compiled_forward_equals_eager_and_resident(tmp_path, backend, storage):
    data = batches(MLP, 3)
    ref = make_model(MLP)
    with torch.no_grad(), one_thread():
        want = [ref(x) for x, _ in data]
    model = offload(make_model(MLP), storage, tmp_path)
    compiled = torch.compile(model, backend=backend)
    with one_thread():
        for (x, _), w in zip(data, want):
            with torch.no_grad():
                assert torch.equal(compiled(x), w)
                assert torch.equal(model(x), w)  # the same model run eagerly, between compiled calls
            assert torch.equal(compiled(x).detach(), w)  # with grad enabled (the weights become leaves)
    # placeholders, not stand-ins: an optimizer built now finds the offloaded weights
    assert all(p.device.type == "meta" for p in compiled.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls,storage,off,in_backward",
                         [(MLP, "disk", "nvme", False), (MLP, "cpu", "cpu", True), (Tied, "ckpt", "cpu", False)])
def test_compiled_training_equals_resident(tmp_path, backend, cls, storage, off, in_backward):
    data = batches(cls, 3)
    kw = dict(offload=off, in_backward=in_backward)
    want_losses, want = resident_run(cls, torch.float32, "AdamW", data, tmp_path, 1, kw)
    model = offload(make_model(cls), storage, tmp_path, cls)
    compiled = torch.compile(model, backend=backend)
    opt = build_opt("AdamW", compiled.parameters(), tmp_path, **kw)  # built from the compiled wrapper
    assert all(opt.is_offloaded(p) for p in compiled.parameters())
    assert_same_losses(train(compiled, opt, data), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), want)
    opt.close()


@pytest.mark.slow
def test_no_recompiles_between_forwards(tmp_path):
    """Each forward fetches new tensors for the weights; none of them is in a graph, so nothing recompiles."""
    model = offload(make_model(MLP), "disk", tmp_path)
    compiled = torch.compile(model, backend="aot_eager")
    data = batches(MLP, 4)
    with build_opt("AdamW", model.parameters(), tmp_path) as opt, one_thread():
        loss_of(compiled, data[0]).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # grad mode is in the graphs' guards: each mode compiles once
            compiled(data[0][0])
        with torch.compiler.set_stance("fail_on_recompile"):
            for batch in data[1:]:
                loss_of(compiled, batch).backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    compiled(batch[0])


def test_fullgraph_is_refused_with_the_reason(tmp_path):
    model = offload(make_model(MLP), "disk", tmp_path)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="swapio") as info:
        compiled(batches(MLP, 1)[0][0])
    assert "fullgraph" in str(info.value)
    with torch.no_grad():  # the model still works, eagerly
        assert torch.equal(model(batches(MLP, 1)[0][0]), make_model(MLP)(batches(MLP, 1)[0][0]))


def test_module_compile_in_place(tmp_path):
    """nn.Module.compile() (compiles the model's call in place, no wrapper module) works the same."""
    x = batches(MLP, 1)[0][0]
    with torch.no_grad():
        want = make_model(MLP)(x)
    model = offload(make_model(MLP), "disk", tmp_path)
    model.compile(backend="aot_eager")
    with torch.no_grad(), one_thread():
        assert torch.equal(model(x), want)
        assert torch.equal(model(x), want)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_transformers_llama_forward_and_step(tmp_path, backend):
    """A tiny transformers Llama (RoPE, RMSNorm, SDPA between the offloaded projections): the compiled offloaded
    model's logits and one training step equal the resident model's, run eagerly."""
    from helpers import hf_tiny
    from swapio.offload import disk_offload
    from swapio.optim import OffloadAdamW
    ids = hf_tiny.inputs()
    ref = hf_tiny.resident("llama").train()
    model = disk_offload(hf_tiny.resident("llama").train(), tmp_path / "od")
    compiled = torch.compile(model, backend=backend)
    with one_thread():
        with torch.no_grad():
            assert torch.equal(compiled(ids).logits, ref(ids).logits)
        losses = []
        for m in (ref, compiled):
            with OffloadAdamW(m.parameters(), lr=1e-2) as opt:
                loss = m(ids, labels=ids).loss
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                with torch.no_grad():
                    losses.append(m(ids).logits)  # the stepped weights
    assert torch.equal(losses[0], losses[2]) and torch.equal(losses[1], losses[3])


@pytest.mark.slow
def test_inductor_forward(tmp_path):
    """The default backend (inductor, a C++ kernel for the tanh between the offloaded layers: about 15 s here).
    Inductor's fused tanh rounds differently from eager's, by an ulp: close, not bit-equal (as resident)."""
    x = batches(MLP, 1)[0][0]
    ref = make_model(MLP)
    model = offload(make_model(MLP), "disk", tmp_path)
    with torch.no_grad():
        want = torch.compile(ref)(x)  # the resident model compiled: the same kernels between the same layers
        got = torch.compile(model)(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, ref(x).detach(), rtol=1e-5, atol=1e-6)
