"""generate() modes of an offloaded model give the resident model's tokens and scores, bitwise: beam search (with
and without early stopping, several returned), sampling with a fixed seed, static cache, no cache, every output
of return_dict_in_generate, a left-padded batch; and a batched text-generation pipeline over a tokenizer built
here. Offloaded to disk and to host memory."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from swapio.offload import cpu_offload, disk_offload  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             attn_implementation="eager")  # eager: attentions are output
IDS = torch.tensor([[0, 0, 7, 8, 9], [9, 10, 11, 12, 13]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.8),
    "beam": dict(num_beams=3, do_sample=False),
    "beam_early_stopping": dict(num_beams=3, early_stopping=True, num_return_sequences=2, do_sample=False),
    "static_cache": dict(cache_implementation="static", do_sample=False),
    "no_cache": dict(use_cache=False, do_sample=False),
    "all_outputs": dict(do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True,
                        output_attentions=True, output_hidden_states=True),
}


def _offload(model, how, tmp_path):
    model = copy.deepcopy(model)
    return disk_offload(model, tmp_path / "off") if how == "disk" else cpu_offload(model)


def _tensors(out):
    """Every tensor of a generate() result, in order (sequences, then each step's scores, attentions...)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if hasattr(out, "keys"):
        return [t for key in out.keys() if key != "past_key_values" for t in _tensors(out[key])]
    return []


@pytest.fixture(scope="module")
def resident():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, vocab_size=100)).eval()


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_generate_modes_equal_the_resident_models(tmp_path, resident, how):
    offloaded = _offload(resident, how, tmp_path)
    for mode, kwargs in MODES.items():
        outs = []
        for model in (resident, offloaded):
            torch.manual_seed(1)
            outs.append(_tensors(model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=5, pad_token_id=0,
                                                **kwargs)))
        expected, got = outs
        assert len(got) == len(expected) > 0, mode
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), mode


def _tokenizer():
    model = tokenizers.models.WordLevel(unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"],
                            tokenizers.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                padding_side="left")


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_batched_text_generation_pipeline_equals_the_resident_models(tmp_path, how):
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    resident = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, vocab_size=len(tokenizer),
                                                                      pad_token_id=0)).eval()
    offloaded = _offload(resident, how, tmp_path)
    texts = ["the cat sat", "a dog ran in the park", "the"]
    outs = [transformers.pipeline("text-generation", model=m, tokenizer=tokenizer)(
        texts, max_new_tokens=4, do_sample=False, batch_size=2) for m in (resident, offloaded)]
    assert outs[1] == outs[0]
