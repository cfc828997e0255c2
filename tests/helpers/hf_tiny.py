"""Tiny transformers models of four architectures (random init from a config, no download), saved with
save_pretrained, and their resident reference outputs: Llama, Qwen2 (tied embeddings), Mistral (RoPE models with
a non-persistent inv_freq buffer) and T5 (encoder-decoder, tied shared embeddings)."""

import pytest
import torch

from helpers.offload import one_thread

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, NEW_TOKENS = 128, 4
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                pad_token_id=0)
ARCHS = {
    "llama": lambda: (transformers.LlamaConfig(**_DECODER), transformers.LlamaForCausalLM),
    "qwen2": lambda: (transformers.Qwen2Config(**_DECODER, tie_word_embeddings=True), transformers.Qwen2ForCausalLM),
    "mistral": lambda: (transformers.MistralConfig(**_DECODER), transformers.MistralForCausalLM),
    "t5": lambda: (transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
                   transformers.T5ForConditionalGeneration),
}


def arch(name):
    """(config, model class) of an architecture."""
    return ARCHS[name]()


def resident(name, seed=0):
    config, cls = arch(name)
    torch.manual_seed(seed)
    return cls(config).eval()


def save(name, directory, sharded=False):
    """The resident model saved with save_pretrained (sharded in a few files when `sharded`); returns it."""
    model = resident(name)
    model.save_pretrained(directory, max_shard_size="20KB" if sharded else "5GB")
    return model


def build_empty(name, how):
    """The model built without weights: `how` = "meta" (torch.device) or "accelerate" (init_empty_weights())."""
    config, cls = arch(name)
    if how == "meta":
        with torch.device("meta"):
            return cls(config).eval()
    import accelerate
    with accelerate.init_empty_weights():
        return cls(config).eval()


def inputs():
    return torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def run(model):
    """(logits, greedy tokens) of a forward and a short generate()."""
    ids = inputs()
    with torch.no_grad(), one_thread():
        if model.config.is_encoder_decoder:
            logits = model(input_ids=ids, decoder_input_ids=ids[:, :3]).logits
        else:
            logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return logits, tokens
