"""A peft model offloaded from the checkpoint of the transformers model it wraps (disk_offload(checkpoint=...)).
Where transformers 5 converts that checkpoint as it loads it (GPT-NeoX's `embed_out` is `lm_head`, ViT's older
layer names), the tensors are found as for the unwrapped model, and the logits equal the resident peft model's;
a checkpoint transformers would merge (Mixtral's experts) is the unwrapped model's clear error, not a bare
"lacks tensor". peft's modules_to_save keep the frozen original as `original_module`, found under the plain
model's name too; its adapters, which no base checkpoint holds, stay resident even frozen (inference)."""
import pytest
import torch

from helpers import hf_zoo
from swapio.offload import disk_offload, remove_offload

peft = pytest.importorskip("peft")
TARGETS = {"gpt_neox": ["query_key_value", "dense_4h_to_h"], "vit": ["q_proj", "v_proj"],
           "mixtral": ["q_proj", "v_proj"]}


def with_lora(name):
    torch.manual_seed(3)  # the adapters' initial values
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[name], init_lora_weights="gaussian")
    return peft.get_peft_model(hf_zoo.resident(name), config).eval()


def logits(name, model):
    with torch.no_grad(), hf_zoo.one_thread():
        return model(**hf_zoo.inputs(name)).logits


@pytest.mark.parametrize("name", ["gpt_neox", "vit"])
def test_peft_model_reads_a_checkpoint_transformers_renames(tmp_path, name):
    """Was a ValueError: "lacks tensor 'base_model.model.lm_head.weight'" (GPT-NeoX), "lacks tensor
    'base_model.model.vit.layers.0.attention.q_proj.base_layer.weight'" (ViT)."""
    hf_zoo.resident(name).save_pretrained(tmp_path)
    want = logits(name, with_lora(name))
    model = disk_offload(with_lora(name), checkpoint=tmp_path, buffer_bytes=16 << 10)
    assert torch.equal(logits(name, model), want)
    remove_offload(model)
    assert torch.equal(logits(name, model), want)


def test_peft_model_of_a_merged_checkpoint_is_the_unwrapped_models_error(tmp_path):
    hf_zoo.resident("mixtral").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj' is not in "
                                         r"the checkpoint: transformers makes it when loading by merging"):
        disk_offload(with_lora("mixtral"), checkpoint=tmp_path)


def test_peft_base_model_reads_a_checkpoint_saved_with_a_head(tmp_path):
    """A peft GPTNeoXModel (no head) from a GPTNeoXForCausalLM directory: transformers strips `gpt_neox.` for
    the base model; swapio said "lacks tensor 'base_model.model.embed_in.weight'"."""
    hf_zoo.resident("gpt_neox").save_pretrained(tmp_path)
    config = peft.LoraConfig(r=4, target_modules=TARGETS["gpt_neox"], init_lora_weights="gaussian")
    torch.manual_seed(3)
    resident = peft.get_peft_model(hf_zoo.transformers.GPTNeoXModel.from_pretrained(tmp_path), config).eval()
    torch.manual_seed(3)
    model = peft.get_peft_model(hf_zoo.transformers.GPTNeoXModel.from_pretrained(tmp_path), config).eval()
    disk_offload(model, checkpoint=tmp_path, buffer_bytes=16 << 10)
    ids = hf_zoo.inputs("gpt_neox")["input_ids"]
    with torch.no_grad(), hf_zoo.one_thread():
        assert torch.equal(model(input_ids=ids).last_hidden_state, resident(input_ids=ids).last_hidden_state)
    remove_offload(model)


@pytest.mark.parametrize("name, saved", [("vit", "classifier"), ("gpt_neox", "lm_head"), ("bert_mlm", "cls")])
def test_modules_to_save_originals_are_read_from_the_checkpoint(tmp_path, name, saved):
    """peft's modules_to_save wraps the module: its frozen `original_module` (offloaded) beside a trainable copy
    (resident). Was a ValueError: "lacks tensor 'base_model.model.classifier.original_module.weight'". GPT-NeoX's
    lm_head is `embed_out` in the file, BERT's decoder is tied to the word embeddings."""
    hf_zoo.resident(name).save_pretrained(tmp_path)
    targets = {"vit": ["q_proj"], "gpt_neox": ["query_key_value"], "bert_mlm": ["query"]}[name]

    def make():
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=targets, modules_to_save=[saved], init_lora_weights="gaussian")
        return peft.get_peft_model(hf_zoo.resident(name), config).eval()
    resident, model = make(), make()
    disk_offload(model, checkpoint=tmp_path, buffer_bytes=16 << 10)
    originals = [p for n, p in model.named_parameters() if ".original_module." in n]
    assert originals and all(p.device.type == "meta" for p in originals)  # offloaded: read from the file
    assert torch.equal(logits(name, model), logits(name, resident))
    with model.disable_adapter(), resident.disable_adapter():  # the original modules compute
        assert torch.equal(logits(name, model), logits(name, resident))
    remove_offload(model)


@pytest.mark.parametrize("saved", [None, "lm_head"])
def test_frozen_adapters_of_an_inference_peft_model_stay_resident(tmp_path, saved):
    """PeftModel.from_pretrained(base, adapter_dir) loads the adapters frozen (inference); swapio streamed them
    like the base weights and looked them up in the base model's checkpoint: "lacks tensor
    'base_model.model.gpt_neox.layers.0.attention.query_key_value.lora_A.default.weight'"."""
    hf_zoo.resident("gpt_neox").save_pretrained(tmp_path / "base")
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, target_modules=TARGETS["gpt_neox"], init_lora_weights="gaussian",
                             modules_to_save=[saved] if saved else None)
    trained = peft.get_peft_model(hf_zoo.resident("gpt_neox"), config)
    with torch.no_grad():  # an adapter (and saved module) that differ from the base
        for n, p in trained.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    trained.save_pretrained(tmp_path / "adapter")
    resident = peft.PeftModel.from_pretrained(hf_zoo.resident("gpt_neox"), tmp_path / "adapter").eval()
    model = peft.PeftModel.from_pretrained(hf_zoo.resident("gpt_neox"), tmp_path / "adapter").eval()
    assert not any(p.requires_grad for p in model.parameters())
    disk_offload(model, checkpoint=tmp_path / "base", buffer_bytes=16 << 10)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n or "modules_to_save" in n]
    assert adapters and all(p.device.type == "cpu" for p in adapters)
    assert torch.equal(logits("gpt_neox", model), logits("gpt_neox", resident))
    remove_offload(model)


@pytest.mark.parametrize("name", ["phi3", "gpt_neox"])
def test_prompt_learning_model_reads_the_base_checkpoint(tmp_path, name):
    """peft's prompt learning wraps the transformers model itself (`base_model.`, not `base_model.model.`):
    "lacks tensor 'base_model.gpt_neox.embed_in.weight'". Phi-3's own `model.` makes the LoRA reading of
    `base_model.model.layers...` (`layers...`) the wrong one there; GPT-NeoX's head is `embed_out` in the file."""
    hf_zoo.resident(name).save_pretrained(tmp_path)

    def make():
        torch.manual_seed(3)
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        return peft.get_peft_model(hf_zoo.resident(name), config).eval()
    resident, model = make(), make()
    disk_offload(model, checkpoint=tmp_path, buffer_bytes=16 << 10)
    assert torch.equal(logits(name, model), logits(name, resident))
    remove_offload(model)
