"""A tiny GPT-2 (random init from a transformers config, no download) and its resident reference outputs."""
import contextlib
import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0)
NEW_TOKENS = 6


def config():
    return transformers.GPT2Config(**CONFIG)


@contextlib.contextmanager
def one_thread():
    """Tiny models on a shared 2-core machine: one thread is several times faster, and the same thread count for
    the reference and the offloaded run keeps every reduction in the same order (exact comparisons)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _reference():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config()).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), one_thread():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return model, ids, logits, tokens


def resident_model():
    """A fresh copy of the reference model (weights in RAM)."""
    return copy.deepcopy(_reference()[0])


def meta_model(dtype=torch.float32):
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config()).to(dtype).eval()
    return model


def reference():
    """(input ids, logits, generate() token ids) of the resident model."""
    return _reference()[1:]


def assert_same_outputs(model):
    ids, logits, tokens = reference()
    with torch.no_grad(), one_thread():
        assert torch.equal(model(ids).logits, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0), tokens)
