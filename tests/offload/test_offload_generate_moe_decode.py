"""generate() of an offloaded MoE model computing on the CPU decodes as the resident model does.

transformers' generate() switches MoE experts from grouped_mm to batched_mm for the decode steps when
model.device is not the CPU. model.device is the first parameter's, a meta placeholder for an offloaded model,
so the offloaded model decoded with batched_mm: the prefill's scores equal, every later step's off in the last
bits (greedy tokens mostly the same, so nothing said). The scores of every step must equal the resident model's.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from swapio.offload import cpu_offload, disk_offload, remove_offload  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=32),
}
GENERATE = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)


def _generate(model):
    ids = torch.tensor([[0, 0, 7, 8], [9, 10, 11, 12]])
    return model.generate(input_ids=ids, attention_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), **GENERATE)


@pytest.mark.parametrize("how", ["disk", "cpu"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_moe_decode_scores_equal_the_resident_models(tmp_path, family, how):
    torch.manual_seed(0)
    resident = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    implementation = resident.config._experts_implementation
    offloaded = copy.deepcopy(resident)
    if how == "disk":
        disk_offload(offloaded, tmp_path / "off")
    else:
        cpu_offload(offloaded)
    expected, got = _generate(resident), _generate(offloaded)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == GENERATE["max_new_tokens"]
    for step, (g, e) in enumerate(zip(got.scores, expected.scores)):
        assert torch.equal(g, e), f"step {step}: scores differ from the resident model's"
    assert offloaded.config._experts_implementation == implementation  # nothing left switched
    remove_offload(offloaded)
    assert "_optimize_model_for_decode" not in vars(offloaded)  # transformers' own method again
    assert torch.equal(_generate(offloaded).sequences, expected.sequences)
