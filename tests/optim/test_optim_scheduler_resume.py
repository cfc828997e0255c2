"""Resuming a run with an lr scheduler, the optimizer through save()/load(), state_dict() or torch.save, the scheduler
through its state_dict(): the resumed run equals the uninterrupted one bit for bit. Schedulers that write betas
(OneCycleLR, CyclicLR with cycle_momentum) and a tensor lr, which the constructor gives every group as one tensor
(as torch does) and LambdaLR updates in place: load() read it back once per group, so a group's fill_ no longer
reached the others and the resumed run went another way than the uninterrupted one."""
import io

import pytest
import torch
import torch.optim.lr_scheduler as sched

import swapio.optim as so
from helpers.optim import one_thread  # noqa: F401

SCHEDULERS = {
    "one-cycle": (1e-2, lambda o: sched.OneCycleLR(o, max_lr=5e-2, total_steps=20)),
    "cyclic-momentum": (1e-2, lambda o: sched.CyclicLR(o, 1e-3, 1e-2, step_size_up=2, cycle_momentum=True,
                                                       base_momentum=0.8, max_momentum=0.95)),
    "lambda-tensor-lr": (torch.tensor(1e-2), lambda o: sched.LambdaLR(o, [lambda e: 0.5 ** e, lambda e: 1.0])),
}


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(300, generator=gen).requires_grad_(True), torch.randn(20, 7, generator=gen).bfloat16()
            .requires_grad_(True)]


def _build(params, mode, lr, make_sched, tmp_path, name):
    extra = {"swap_dir": tmp_path / name} if mode == "nvme" else {}
    lr = lr.clone() if torch.is_tensor(lr) else lr
    opt = so.OffloadAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=lr, offload=mode, **extra)
    return opt, make_sched(opt)


def _run(opt, scheduler, params, steps):
    for k in steps:
        gen = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
        scheduler.step()


@pytest.mark.parametrize("via", ["save", "state_dict", "torch.save"])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("which", SCHEDULERS, ids=SCHEDULERS)
def test_a_run_resumed_with_its_scheduler_equals_the_uninterrupted_one(which, mode, via, tmp_path):
    lr, make_sched = SCHEDULERS[which]
    whole = _params()
    opt, scheduler = _build(whole, mode, lr, make_sched, tmp_path, "whole")
    _run(opt, scheduler, whole, range(6))
    opt.close()

    resumed = _params()
    opt, scheduler = _build(resumed, mode, lr, make_sched, tmp_path, "first")
    _run(opt, scheduler, resumed, range(3))
    if via == "save":
        opt.save(tmp_path / "ckpt")
    else:
        saved = opt.state_dict()
        if via == "torch.save":
            buffer = io.BytesIO()
            torch.save(saved, buffer)
            buffer.seek(0)
            saved = torch.load(buffer)
    scheduler_state = scheduler.state_dict()
    opt.close()
    opt, scheduler = _build(resumed, mode, lr, make_sched, tmp_path, "second")
    if via == "save":
        opt.load(tmp_path / "ckpt")
    else:
        opt.load_state_dict(saved)
    scheduler.load_state_dict(scheduler_state)
    _run(opt, scheduler, resumed, range(3, 6))
    for a, b in zip(whole, resumed):
        assert torch.equal(a.detach(), b.detach())
    opt.close()


def test_a_tensor_the_groups_shared_loads_back_as_one_tensor(tmp_path):
    params = _params()
    opt = so.OffloadAdamW([{"params": params[:1]}, {"params": params[1:]}], lr=torch.tensor(1e-2))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.save(tmp_path / "ckpt")
    opt.load(tmp_path / "ckpt")
    assert opt.param_groups[0]["lr"] is opt.param_groups[1]["lr"]
    opt.close()
