"""peft's DoRA (use_dora=True) over an offloaded base. A DoRA layer reads its base layer's weight in its own
forward (outside the base layer's) and computes its magnitude from that weight when created. Offloading a DoRA
peft model with its LoRA layers' class in preload_module_classes computes exactly what the resident model does
(merges too); without it, offloading raises a ValueError saying so (the forward raised torch's "Tensor on device
cpu is not on the expected device meta!"). DoRA applied after offloading got a NaN magnitude (the base weight's
stand-in), which a merge wrote into the stored weights without a word: it now raises, and nothing is written."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload
from helpers import hf_tiny

peft = pytest.importorskip("peft")


def add_dora(model):
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       use_dora=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


def offload(how, model, tmp_path, **kwargs):
    if how == "disk":
        return disk_offload(model, offload_dir=tmp_path / "od", buffer_bytes=16 << 10, **kwargs)
    return cpu_offload(model, **kwargs)


def logits(model):
    return hf_tiny.run(model)[0]


@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_dora_model_offloaded_with_its_layers_preloaded_like_resident(tmp_path, how):
    ref = add_dora(hf_tiny.resident("llama"))
    model = offload(how, add_dora(hf_tiny.resident("llama")), tmp_path, preload_module_classes=["Linear"])
    assert torch.equal(logits(model), logits(ref))
    want, got = ref.merge_and_unload(), model.merge_and_unload()
    assert torch.equal(logits(got), logits(want))


@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_dora_model_offloaded_without_preloading_its_layers_is_refused(tmp_path, how):
    model = add_dora(hf_tiny.resident("llama"))
    with pytest.raises(ValueError, match=r"q_proj is a peft DoRA layer.*preload_module_classes=\['Linear'\]"):
        offload(how, model, tmp_path)
    assert not any(p.is_meta for p in model.parameters())  # left as it was
    kept = offload(how, model, tmp_path, keep_resident=[n for n, m in model.named_modules()
                                                        if n.endswith(("q_proj", "v_proj"))])
    assert torch.equal(logits(kept), logits(add_dora(hf_tiny.resident("llama"))))


@pytest.mark.parametrize("merge_first", [False, True])
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_dora_applied_after_offloading_raises_and_writes_nothing(tmp_path, how, merge_first):
    base = hf_tiny.resident("llama")
    model = add_dora(offload(how, hf_tiny.resident("llama"), tmp_path))
    with pytest.raises(RuntimeError, match=r"DoRA \(use_dora=True\) was applied to a model offloaded by swapio"):
        model.merge_and_unload() if merge_first else logits(model)
    unloaded = model.unload()
    remove_offload(unloaded)
    for name, p in base.named_parameters():
        assert torch.equal(unloaded.get_parameter(name), p), name
