"""torch.optim habits the other tests leave out, each against torch.optim.AdamW(fused=True) doing the same on an
identical resident model (bit for bit on fp32 parameters): lr schedulers that write other hyperparameters or react
to a metric, step hooks that edit gradients and the lr (the optimizer's own and torch's global ones),
torch.optim.swa_utils, and two offloaded optimizers in one process, one closed from another thread while the other
steps."""
import threading

import pytest
import torch
import torch.optim.lr_scheduler as sched
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

import swapio.optim as so
from helpers.optim import one_thread, rel_diff  # noqa: F401

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="torch's fused CPU AdamW uses fused multiply-adds only in AVX2/AVX-512 builds")


def _pair(mode, tmp_path, sizes=(300, 1000)):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).requires_grad_(True) for n in sizes]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    return params, ref, so.OffloadAdamW(params, lr=1e-2, offload=mode, **extra), \
        torch.optim.AdamW(ref, lr=1e-2, fused=True)


def _feed(params, ref, gen):
    for p, q in zip(params, ref):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()


SCHEDULERS = {
    "cyclic-momentum": lambda o: sched.CyclicLR(o, 1e-3, 1e-2, step_size_up=3, cycle_momentum=True,
                                                base_momentum=0.8, max_momentum=0.95),
    "plateau": lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "sequential": lambda o: sched.SequentialLR(o, [sched.LinearLR(o, 0.1, total_iters=3),
                                                   sched.ExponentialLR(o, 0.9)], milestones=[3]),
    "chained": lambda o: sched.ChainedScheduler([sched.ConstantLR(o, 0.5, total_iters=4),
                                                 sched.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("which", SCHEDULERS, ids=SCHEDULERS)
def test_schedulers_step_as_torch(which, mode, tmp_path):
    params, ref, ours, theirs = _pair(mode, tmp_path)
    mine, torch_s = SCHEDULERS[which](ours), SCHEDULERS[which](theirs)
    gen = torch.Generator().manual_seed(1)
    for k in range(8):
        _feed(params, ref, gen)
        ours.step()
        theirs.step()
        for s in (mine, torch_s):
            s.step(float(k % 3 == 0)) if which == "plateau" else s.step()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, ref))
    assert ours.param_groups[0]["betas"] == theirs.param_groups[0]["betas"]
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_step_hooks_that_edit_gradients_and_lr_act_as_with_torch(mode, tmp_path):
    params, ref, ours, theirs = _pair(mode, tmp_path)
    calls = []

    def halve(opt, args, kwargs):
        for group in opt.param_groups:
            group["lr"] *= 0.9
            for p in group["params"]:
                p.grad.mul_(0.5)

    handles = [opt.register_step_pre_hook(halve) for opt in (ours, theirs)]
    handles += [opt.register_step_post_hook(lambda o, a, k: calls.append(("post", type(o).__name__)))
                for opt in (ours, theirs)]
    handles += [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", type(o).__name__))),
                register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", type(o).__name__)))]
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            _feed(params, ref, gen)
            ours.step()
            theirs.step()
    finally:
        for h in handles:
            h.remove()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, ref))
    assert calls[:3] == [("global pre", "OffloadAdamW"), ("post", "OffloadAdamW"), ("global post", "OffloadAdamW")]
    assert len(calls) == 3 * 2 * 3
    ours.close()


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_swa_utils_with_an_offloaded_optimizer_as_with_torch(mode, tmp_path):
    """AveragedModel (EMA and SWA), SWALR and update_bn; a real model's gradients, so within float32 rounding
    (torch's fused kernel rounds exp_avg_sq otherwise than its single-tensor one, docs/kernel.md)."""
    models = [_bn_model(), _bn_model()]
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    opts = [so.OffloadAdamW(models[0].parameters(), lr=1e-2, offload=mode, **extra),
            torch.optim.AdamW(models[1].parameters(), lr=1e-2, fused=True)]
    emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True) for m in models]
    swas = [AveragedModel(m) for m in models]
    swalrs = [SWALR(o, swa_lr=0.05, anneal_epochs=3) for o in opts]
    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(10, 8, generator=gen) for _ in range(6)]
    for x in data:
        for m, o, ema, swa, s in zip(models, opts, emas, swas, swalrs):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
            ema.update_parameters(m)
            swa.update_parameters(m)
            s.step()
    for swa in swas:
        update_bn(data, swa)
    for a, b in [*zip(*(m.parameters() for m in models)), *zip(*(e.parameters() for e in emas)),
                 *zip(*(s.parameters() for s in swas)), *zip(*(s.buffers() for s in swas))]:
        assert rel_diff(a, b) <= 1e-5
    assert opts[0].param_groups[0]["lr"] == opts[1].param_groups[0]["lr"]
    opts[0].close()


@pytest.mark.parametrize("modes", [("cpu", "nvme"), ("nvme", "nvme")])
def test_two_optimizers_one_closed_from_another_thread_while_the_other_steps(modes, tmp_path):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5000, generator=gen).requires_grad_(True) for _ in range(4)]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    extra = [{"swap_dir": tmp_path} if m == "nvme" else {} for m in modes]  # (the same swap_dir for both)
    first = so.OffloadAdamW(params[:2], lr=1e-2, offload=modes[0], **extra[0])
    second = so.OffloadAdam(params[2:], lr=1e-2, weight_decay=0.1, offload=modes[1], **extra[1])
    first_ref = torch.optim.AdamW(ref[:2], lr=1e-2, fused=True)
    second_ref = torch.optim.Adam(ref[2:], lr=1e-2, weight_decay=0.1, fused=True)
    _feed(params, ref, gen)
    for opt in (first, second, first_ref, second_ref):
        opt.step()
    closer = threading.Thread(target=first.close)
    closer.start()
    for _ in range(3):
        _feed(params, ref, gen)
        second.step()
        second_ref.step()
    closer.join()
    with pytest.raises(RuntimeError, match="closed"):
        first.step()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params[2:], ref[2:]))
    assert len(list(tmp_path.iterdir())) == 1  # the closed one's private directory is gone, the other's kept
    second.close()
    assert not list(tmp_path.iterdir())
