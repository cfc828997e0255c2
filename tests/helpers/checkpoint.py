"""Shared pieces of the swapio.checkpoint tests: a training state like real code has, and comparisons."""
import collections
import os

import torch

from swapio.safetensors import commit


def training_state(seed=0, width=24):
    """{"model", "optimizer", "step", ...}: a small model's state dict and a stepped AdamW's (int keys)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100, "epoch": 1.5,
            "done": False, "name": "run-1", "rng": None, "history": [(1, 0.5), (2, 0.25)]}


def assert_same(a, b, path="state"):
    """Same structure, same container types, tensors equal in dtype, shape and values (bits for floats)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert bytes_of(a) == bytes_of(b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def bytes_of(t):
    """A tensor's elements' bytes in row-major order (any dtype, sub-byte ones included)."""
    t = t.detach()
    if t.element_size() == 1:
        t = t.view(torch.uint8)
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).clone().numpy().tobytes() if t.numel() else b""


def leftovers(directory):
    """Temporary files of saves in directory (once the replaced files a save unlinks in the background are gone)."""
    commit.wait_for_unlinks()
    return [n for n in os.listdir(directory) if commit.TAG in n]


def ordered(d):
    return collections.OrderedDict(d)
