"""Training offloaded transformers weights with OffloadAdamW (weight_decay > 0) against the resident model trained
with torch.optim.AdamW, over three steps: Mixtral and Qwen2-MoE (fused expert tensors whose rows for experts a
batch does not route to get zero gradients) and tied embeddings (BertForMaskedLM's decoder, Gemma's head, Bloom's
with ALiBi).
The middle step's loss reads only the first layer's output, so the later layers and the head get no gradient:
torch skips a parameter whose grad is None (no decay, no moment decay) and swapio must too.

The reference is torch's fused AdamW: its kernel rounds as swapio's does, so the weights are compared bit for
bit (torch's own single-tensor AdamW differs from its fused one in the last bits, which Adam's division by a small
second moment can amplify, as it does on the routers here)."""
import pytest
import torch

from helpers import hf_zoo
from helpers.offload import one_thread
from swapio.offload import cpu_offload, disk_offload, remove_offload
from swapio.optim import OffloadAdamW

LR, DECAY = 1e-2, 0.1


def batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, hf_zoo.VOCAB, (1, 3), generator=g) for _ in range(3)]


def loss_of(model, step, ids):
    if step == 1:  # only the first layer's output: the later layers, the final norm and the head get no gradient
        return model.base_model(input_ids=ids, output_hidden_states=True).hidden_states[1].square().mean()
    return model(input_ids=ids, labels=ids).loss


def train(model, opt, seen=None):
    """Three steps; `seen`: {step: names of parameters with no gradient} and {step: zero expert rows}."""
    model.train()
    with one_thread():
        for step, ids in enumerate(batches()):
            loss_of(model, step, ids).backward()
            if seen is not None:
                seen["none"][step] = {n for n, p in model.named_parameters() if p.grad is None}
                seen["zero_rows"][step] = sum(int((p.grad.flatten(1) == 0).all(1).sum())
                                              for n, p in model.named_parameters()
                                              if "experts" in n and p.grad is not None)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("name,kind,in_backward", [("mixtral", "disk", False), ("mixtral", "cpu", True),
                                                   ("qwen2_moe", "cpu", False), ("bert_mlm", "disk", False),
                                                   ("gemma", "cpu", False), ("bloom", "disk", False)])
def test_trains_as_torch_adamw_skipping_parameters_without_gradient(tmp_path, name, kind, in_backward):
    ref = hf_zoo.resident(name)
    seen = {"none": {}, "zero_rows": {}}
    train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=DECAY, fused=True), seen)
    assert not seen["none"][0] and seen["none"][1]  # the case under test happens
    if name in ("mixtral", "qwen2_moe"):
        assert sum(seen["zero_rows"].values()) > 0  # some expert got no token in some step
    model = hf_zoo.resident(name)
    model = disk_offload(model, tmp_path / "od") if kind == "disk" else cpu_offload(model)
    with OffloadAdamW(model.parameters(), lr=LR, weight_decay=DECAY, in_backward=in_backward) as opt:
        train(model, opt)
    remove_offload(model)
    got = dict(model.named_parameters())
    for n, want in ref.named_parameters():
        assert torch.equal(got[n], want), n
    if name in ("bert_mlm", "gemma", "bloom"):  # the tie survived training
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
