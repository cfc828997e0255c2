"""torch.autograd.grad(loss, model.parameters()) and loss.backward(inputs=[...]) naming offloaded weights: such a
weight is a placeholder between forwards, in no graph (each forward computes with a fresh copy), so torch gave it
no gradient without a word: None with allow_unused=True, and backward(inputs=...) accumulated nothing (step()
left the weight as it was, where the resident model updates it). Now a RuntimeError naming the cause, before any
gradient is computed; gradients with respect to other inputs (inputs_embeds of a frozen offloaded model) still
equal the resident model's."""
import pytest
import torch

from helpers.offload_training import MLP, batches, build_opt, loss_of, make_model, offload, one_thread

pytest.importorskip("safetensors")

STORAGES = ["disk", "cpu"]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("call", [
    lambda loss, params: torch.autograd.grad(loss, params, allow_unused=True),
    lambda loss, params: torch.autograd.grad(loss, params),
    lambda loss, params: torch.autograd.grad(loss, inputs=params[0]),
    lambda loss, params: loss.backward(inputs=[params[0]]),
    lambda loss, params: loss.backward(inputs=params[0]),
    lambda loss, params: torch.autograd.backward(loss, inputs=params),
], ids=["grad-allow-unused", "grad", "grad-one-tensor", "backward-inputs", "backward-one-tensor", "autograd-backward"])
def test_offloaded_weights_as_autograd_inputs_are_refused(tmp_path, storage, call):
    model = offload(make_model(), storage, tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="cpu") as opt:
        with one_thread():
            loss = loss_of(model, batches(MLP, 1)[0])
            with pytest.raises(RuntimeError, match="offloaded by swapio as inputs"):
                call(loss, list(model.parameters()))
            loss.backward()  # the graph is intact: the usual backward still works
            opt.step()


@pytest.mark.parametrize("storage", STORAGES)
def test_gradients_of_other_inputs_through_frozen_offloaded_weights(tmp_path, storage):
    ref = make_model().requires_grad_(False)
    model = offload(make_model().requires_grad_(False), storage, tmp_path)
    x, _ = batches(MLP, 1)[0]
    with one_thread():
        want = [torch.autograd.grad(ref(x0).square().sum(), x0)[0] for x0 in [x.clone().requires_grad_()]][0]
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = torch.autograd.grad(model(x1).square().sum(), [x1])[0]
        model(x2).square().sum().backward(inputs=[x2])
    assert torch.equal(got, want)
    assert torch.equal(x2.grad, want)
