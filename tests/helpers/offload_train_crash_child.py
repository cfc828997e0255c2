"""The child of test_offload_train_crash.py, imported once by the fork server (helpers/fork.py): it trains a small
disk-offloaded model STEPS steps with an OffloadAdamW, saving the optimizer after each step from SAVE_AT on, and
saves its final weights; optionally SIGKILLs itself at the n-th call of a method, or resumes from the checkpoint
on a model built on meta."""
import importlib
import os
import signal

import torch

from swapio.offload import disk_offload, remove_offload
from swapio.optim import OffloadAdamW

STEPS, SAVE_AT = 4, 2


def _make(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(dtype)


def _kill_at(kill):
    """SIGKILL at the n-th call ("module.Class.method:n") of that method, counted from now."""
    where, n = kill.rsplit(":", 1)
    module, cls, method = where.rsplit(".", 2)
    owner = getattr(importlib.import_module(module), cls)
    inner, calls = getattr(owner, method), [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == int(n):
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(*a, **k)

    setattr(owner, method, wrapper)


def train(od, ckpt, swap, out, resume, kill, dtype, in_backward, offload):
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype)
    if kill is not None:
        _kill_at(kill)
    if resume:
        with torch.device("meta"):
            model = _make(dtype)
    else:
        model = _make(dtype)
    disk_offload(model, offload_dir=od)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload=offload, swap_dir=swap, in_backward=in_backward)
    start = 0
    if resume:
        opt.load(ckpt)
        start = int(next(iter(opt.state.values()))["step"])
    for i in range(start, STEPS):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 32, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)
        loss = (model(x) - y).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i + 1 >= SAVE_AT:
            opt.save(ckpt)
    opt.close()
    remove_offload(model)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
