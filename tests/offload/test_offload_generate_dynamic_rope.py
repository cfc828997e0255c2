"""generate() of a Llama with dynamic RoPE scaling (its rotary embedding assigns inv_freq again in eval mode, once
the sequence outgrows max_position_embeddings) offloaded with offload_buffers=True: a RuntimeError naming the
buffer and keep_resident, not advice to use eval mode (the model is in eval mode already); with the rotary module
kept resident, the resident model's tokens."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from swapio.offload import cpu_offload, disk_offload  # noqa: E402

GENERATE = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_dynamic_rope_with_offloaded_buffers(tmp_path, how):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=8,
                                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    resident = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 99, (2, 12))  # longer than max_position_embeddings: inv_freq is recomputed

    def offload(**kwargs):
        model = copy.deepcopy(resident)
        if how == "disk":
            return disk_offload(model, tmp_path / str(len(kwargs)), offload_buffers=True, **kwargs)
        return cpu_offload(model, offload_buffers=True, **kwargs)

    with pytest.raises(RuntimeError, match=r"inv_freq(.|\n)*keep_resident=\['model.rotary_emb'\]") as info:
        offload().generate(ids, **GENERATE)
    assert "eval mode" not in str(info.value)
    kept = offload(keep_resident=["model.rotary_emb"])
    assert torch.equal(kept.generate(ids, **GENERATE), resident.generate(ids, **GENERATE))
