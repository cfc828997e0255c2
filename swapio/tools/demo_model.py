"""The model and data of `swapio demo`: a small GPT in plain torch, trained on the bytes of text that ships with
Python (the source of a few standard-library modules), so the demo needs no download."""
import importlib
import inspect
import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256  # bytes
TEXT_MODULES = ("argparse", "textwrap", "collections", "inspect", "functools", "pathlib", "json.decoder")


def corpus_bytes():
    """A few hundred KB of English prose and Python from the standard library, as a uint8 tensor."""
    parts = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        try:
            parts.append(inspect.getsource(module))
        except (OSError, TypeError):  # no source shipped (e.g. only .pyc): fall back to the docstrings
            parts.append(module.__doc__ or "")
            parts.extend(getattr(v, "__doc__", None) or "" for v in vars(module).values() if callable(v))
    data = "\n".join(parts).encode("utf-8", errors="replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """Random windows of `context` + 1 bytes, reproducible from the seed: (inputs, targets) pairs."""

    def __init__(self, data, context, batch, seed):
        if data.numel() <= context + 1:
            raise ValueError(f"the corpus ({data.numel()} bytes) is shorter than the context ({context})")
        self.data, self.context, self.batch = data, context, batch
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        starts = torch.randint(0, self.data.numel() - self.context - 1, (self.batch,), generator=self.gen)
        rows = torch.stack([self.data[s:s + self.context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level GPT: token and position embeddings, `layers` pre-norm blocks, a head tied to the embedding."""

    def __init__(self, layers=4, width=128, heads=4, context=64):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if name.endswith("proj.weight") else 1))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
