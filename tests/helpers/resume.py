"""Helpers for the resume tests: small models stepped with reproducible gradients, and bitwise comparisons of
optimizer states against an uninterrupted reference run."""
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS

# 70000 elements span several 64 KiB chunks in nvme mode (SMALL_BUFFERS); 513 ends mid int8 block.
SHAPES = [(3000,), (17, 33), (70000,), (513,), (5,)]
KINDS = {"adamw": (so.OffloadAdamW, dict(lr=1e-2, weight_decay=0.05)),
         "adam": (so.OffloadAdam, dict(lr=1e-2, weight_decay=0.05)),
         "lion": (so.OffloadLion, dict(lr=1e-3, weight_decay=0.1))}


def make_params(seed=0, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in shapes]


def make_opt(kind, params, mode, swap_dir, state_dtype="fp32"):
    cls, hyper = KINDS[kind]
    extra = {"swap_dir": swap_dir, **SMALL_BUFFERS} if mode == "nvme" else {}
    return cls(params, offload=mode, state_dtype=state_dtype, **hyper, **extra)


def set_grads(params, step, only=None):
    """The gradients of step `step` (reproducible); parameters not in `only` (indices) get None."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g) * torch.rand(p.shape, generator=g).pow(3)).to(p.dtype)
        p.grad = grad if only is None or i in only else None


def train(opt, params, first, last):
    """Steps first .. last (inclusive)."""
    for step in range(first, last + 1):
        set_grads(params, step)
        opt.step()


def assert_trains_like_fresh(opt, params, first, last, swap_dir, kind="adamw", state_dtype="fp32",
                             params_fn=make_params):
    """Steps first .. last of opt end bitwise where a fresh cpu-mode optimizer's steps 1 .. last end (the run
    goes on as if it had never stopped, or had never seen what was tried on it)."""
    train(opt, params, first, last)
    ref_params = params_fn()
    ref = make_opt(kind, ref_params, "cpu", swap_dir, state_dtype)
    train(ref, ref_params, 1, last)
    assert_same(snapshot(opt, params), snapshot(ref, ref_params))
    ref.close()


def snapshot(opt, params):
    """Everything that decides the rest of a run, as plain tensors: parameters, counts, exported state."""
    sd = opt.state_dict()
    return {"params": [p.detach().clone() for p in params],
            "state": {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()},
            "groups": [{k: v for k, v in g.items()} for g in sd["param_groups"]]}


def assert_same(a, b):
    """Bitwise equality of two snapshots."""
    for i, (p, q) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(p, q), f"parameter {i} differs"
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys(), k
        for name, t in a["state"][k].items():
            assert torch.equal(t, b["state"][k][name]), (k, name)
    assert a["groups"] == b["groups"]
