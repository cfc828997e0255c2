"""Tiny transformers models of architectures beyond hf_tiny's four (random init from a config, no download), the
inputs each takes and what it outputs: the offload model-zoo sweep (tests/offload/test_offload_model_zoo.py)."""
import pytest
import torch

from helpers.offload import one_thread

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, NEW_TOKENS = 128, 4
_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
_DECODER = dict(_SIZES, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                pad_token_id=0)
_MOE = dict(num_experts_per_tok=2, output_router_logits=False)


def _bert(**kw):
    return dict(_SIZES, max_position_embeddings=64, type_vocab_size=2, pad_token_id=0, **kw)


# name: (config class name, config kwargs, model class name, input kind)
ARCHS = {
    "gemma": ("GemmaConfig", dict(_DECODER, head_dim=8), "GemmaForCausalLM", "text"),
    "gemma2": ("Gemma2Config", dict(_DECODER, head_dim=8, sliding_window=4), "Gemma2ForCausalLM", "text"),
    "gemma3": ("Gemma3TextConfig", dict(_DECODER, head_dim=8, sliding_window=4), "Gemma3ForCausalLM", "text"),
    "phi3": ("Phi3Config", _DECODER, "Phi3ForCausalLM", "text"),
    "gpt_neox": ("GPTNeoXConfig", dict(_SIZES, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                                       pad_token_id=0), "GPTNeoXForCausalLM", "text"),
    "opt": ("OPTConfig", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                              vocab_size=VOCAB, word_embed_proj_dim=32, max_position_embeddings=64, bos_token_id=0,
                              eos_token_id=1, pad_token_id=0), "OPTForCausalLM", "text"),
    "bloom": ("BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0,
                                  eos_token_id=1, pad_token_id=0), "BloomForCausalLM", "text"),
    "falcon": ("FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=0), "FalconForCausalLM", "text"),
    "falcon_alibi": ("FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          vocab_size=VOCAB, alibi=True, bos_token_id=0, eos_token_id=1,
                                          pad_token_id=0), "FalconForCausalLM", "text"),
    "bert": ("BertConfig", _bert(), "BertModel", "encoder"),
    "bert_mlm": ("BertConfig", _bert(), "BertForMaskedLM", "encoder"),
    "mixtral": ("MixtralConfig", dict(_DECODER, num_local_experts=4, **_MOE), "MixtralForCausalLM", "text"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         num_experts=4, **_MOE), "Qwen2MoeForCausalLM", "text"),
    "whisper": ("WhisperConfig", dict(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                                      d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
                                      encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                                      max_target_positions=32, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                                      decoder_start_token_id=2), "WhisperForConditionalGeneration", "audio"),
    "vit": ("ViTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=16, patch_size=4, num_labels=3), "ViTForImageClassification", "image"),
    "clip": ("CLIPConfig", dict(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=16),
                                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, image_size=16, patch_size=4),
                                projection_dim=16), "CLIPModel", "text_image"),
}


def arch(name):
    """(config, model class) of an architecture; a skip when this transformers lacks it."""
    config_name, kwargs, model_name, _ = ARCHS[name]
    if not hasattr(transformers, config_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    return getattr(transformers, config_name)(**kwargs), getattr(transformers, model_name)


def resident(name, seed=0):
    config, cls = arch(name)
    torch.manual_seed(seed)
    return cls(config).eval()


def generative(name):
    return ARCHS[name][3] in ("text", "audio")


def inputs(name, seed=1):
    """The keyword inputs of a forward."""
    g = torch.Generator().manual_seed(seed)
    kind = ARCHS[name][3]
    ids = torch.randint(2, VOCAB, (2, 7), generator=g)
    if kind == "text":
        return {"input_ids": ids}
    if kind == "encoder":
        return {"input_ids": ids, "token_type_ids": (torch.arange(7) > 3).long().expand(2, 7),
                "attention_mask": torch.ones(2, 7, dtype=torch.long).index_fill_(1, torch.tensor([6]), 0)}
    if kind == "audio":
        return {"input_features": torch.randn(2, 8, 16, generator=g), "decoder_input_ids": ids[:, :3]}
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    return {"pixel_values": pixels} if kind == "image" else {"input_ids": ids, "pixel_values": pixels}


def outputs(name, model):
    """Every tensor a forward returns that a user reads (logits, pooled outputs, embeddings), and the greedy tokens
    of a short generate() for generative models."""
    kw = inputs(name)
    with torch.no_grad(), one_thread():
        out = model(**kw)
        got = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        if generative(name):
            if ARCHS[name][3] == "audio":
                got["tokens"] = model.generate(input_features=kw["input_features"], max_new_tokens=NEW_TOKENS,
                                               do_sample=False, min_new_tokens=NEW_TOKENS)
            else:
                got["tokens"] = model.generate(kw["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
                                               min_new_tokens=NEW_TOKENS)
    return got
