"""Fine-tuning with frozen offloaded weights: backward through offloaded modules fetches their weights again
(autograd keeps tokens, not weights), so gradients of resident trainable parts equal the resident model's; a
gradient reaching an offloaded weight that requires grad is a clear error."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload, stats
from helpers.offload import one_thread, reference, resident_model


class LoRA(torch.nn.Module):
    """A low-rank adapter around a frozen GPT-2 Conv1D (trainable, resident)."""

    def __init__(self, inner, rank=4):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.inner = inner
        self.a = torch.nn.Parameter(torch.randn(inner.weight.shape[0], rank, generator=g) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(rank, inner.nf, generator=g) * 0.1)

    def forward(self, x):
        return self.inner(x) + x @ self.a @ self.b


def lora_step(model):
    """Adds an adapter to the first block (after offloading: it stays resident) and runs forward + backward."""
    block = model.transformer.h[0].attn
    block.c_attn = LoRA(block.c_attn)
    ids = reference()[0]
    with one_thread():
        loss = model(ids, labels=ids).loss
        loss.backward()
    return loss.detach(), block.c_attn.a.grad, block.c_attn.b.grad


@pytest.mark.parametrize("kind", ["disk", "disk-tiny-ring", "cpu"])
def test_lora_gradients_through_offloaded_layers_equal_resident(tmp_path, kind):
    want = lora_step(resident_model().requires_grad_(False))
    model = resident_model().requires_grad_(False)
    if kind == "cpu":
        cpu_offload(model)
    else:  # a ring smaller than most records: every region is reused long before backward
        disk_offload(model, tmp_path / "od", buffer_bytes=(256 << 20) if kind == "disk" else 16 << 10)
    got = lora_step(model)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    if kind != "cpu":
        assert stats(model)["refetches"] > 0  # backward fetched weights again instead of keeping them
    remove_offload(model)


def test_new_head_kept_resident_is_trained(tmp_path):
    torch.manual_seed(5)
    head = torch.nn.Linear(64, 3)

    def run(model):
        model.requires_grad_(False)
        model.head = head_copy = torch.nn.Linear(64, 3)
        head_copy.load_state_dict(head.state_dict())
        return model, head_copy

    def step(model, head_copy):
        ids = reference()[0]
        with one_thread():
            hidden = model.transformer(ids).last_hidden_state
            loss = head_copy(hidden).square().mean()
            loss.backward()
        return loss.detach(), head_copy.weight.grad

    want = step(*run(resident_model()))
    model, head_copy = run(resident_model())
    disk_offload(model, tmp_path / "od", keep_resident=["head"], buffer_bytes=64 << 10)
    assert head_copy.weight.device.type == "cpu" and model.head is head_copy
    got = step(model, head_copy)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_gradient_reaching_an_offloaded_weight_is_a_clear_error(tmp_path):
    model = disk_offload(resident_model(), tmp_path / "od")  # weights still require grad
    ids = reference()[0]
    with one_thread():
        loss = model(ids, labels=ids).loss  # forward with grad enabled works
        with pytest.raises(ValueError, match="offloaded weight .*requires grad"):
            loss.backward()
