"""enable_activation_offload under accelerate's mixed precision: prepare() wraps model.forward in autocast, and
unwrap_model(keep_fp32_wrapper=False) binds the innermost forward it finds back onto the model. That forward was
swapio's wrapper, which is no function: bound, it got the model as an extra argument (a TypeError). The unwrapped
model must compute as the plain one, its forwards still offloaded; the signature stays the model's (Trainer
reads it to pick the dataset's columns)."""
import inspect

import pytest
import torch

from swapio.offload import disable_activation_offload, enable_activation_offload

accelerate = pytest.importorskip("accelerate")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, input_ids, labels=None):
        return self.lin(input_ids).tanh().square().sum()


def test_unwrap_model_without_the_fp32_wrapper_keeps_the_offload(tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(model(x), x)[0]
    act = enable_activation_offload(model, to="nvme", swap_dir=tmp_path, min_bytes=0)
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "labels"]
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    prepared = accelerator.prepare(model)
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    before = act.stats()["tensors"]
    assert torch.equal(torch.autograd.grad(unwrapped(x), x)[0], want)
    assert act.stats()["tensors"] > before
    assert list(inspect.signature(unwrapped.forward).parameters) == ["input_ids", "labels"]
    disable_activation_offload(model)
    assert torch.equal(torch.autograd.grad(model(x), x)[0], want)


def test_disable_after_prepare_keeps_autocast(tmp_path):
    """disable_activation_offload of a model prepared (bf16) after enable_activation_offload: accelerate's autocast
    wrapper, installed over swapio's forward, stays (it was dropped, silently: the forward then ran in fp32), and
    unwrap_model(keep_fp32_wrapper=False) after it gives the plain forward (it raised a TypeError)."""
    def outputs(offload):
        torch.manual_seed(0)
        model, x = Net(), torch.randn(4, 8)
        if offload:
            enable_activation_offload(model, to="nvme", swap_dir=tmp_path, min_bytes=0)
        prepared = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
        if offload:
            disable_activation_offload(model)
        autocast_out = prepared(x).detach()
        unwrapped = accelerate.Accelerator(cpu=True).unwrap_model(prepared, keep_fp32_wrapper=False)
        return autocast_out, unwrapped(x).detach()
    want = outputs(False)
    assert not torch.equal(*want)  # bf16 autocast shows in the first
    for got, w in zip(outputs(True), want):
        assert torch.equal(got, w)
