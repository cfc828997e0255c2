"""A parameter's layout or a group's options changed after the first step, as torch users do it
(model.to(memory_format=torch.channels_last), amsgrad turned on in one group): either it steps as torch.optim.AdamW
does, or the step is refused before any parameter is stepped, in both modes. cpu mode refused at the changed
parameter, after stepping the ones before it, so a step given again after the fix stepped those twice."""
import copy

import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, masters, one_thread, rel_diff  # noqa: F401


def _conv_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Conv2d(4, 8, 3), torch.nn.Linear(6, 3)).to(dtype)


def _feed(model, ref, gen, dtype):
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        q.grad = p.grad.float().clone()  # (its own tensor: a later model.bfloat16() converts p.grad in place)


def _pair(mode, dtype, tmp_path):
    model = _conv_model(dtype)
    ref = copy.deepcopy(model).float()
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    return model, ref, so.OffloadAdamW(model.parameters(), lr=1e-2, offload=mode, **extra), \
        torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_fp32_model_made_channels_last_after_a_step_is_refused_before_anything_is_stepped(mode, tmp_path):
    """An fp32 CPU parameter is its own master; made channels_last it needs one its state lacks: refused, naming
    the change, with every parameter untouched (the Linear before the Conv2d too); made contiguous again, the run
    goes on as torch's."""
    model, ref, ours, theirs = _pair(mode, torch.float32, tmp_path)
    gen = torch.Generator().manual_seed(1)
    _feed(model, ref, gen, torch.float32)
    ours.step()
    theirs.step()
    model.to(memory_format=torch.channels_last)
    _feed(model, ref, gen, torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="contiguity"):
        ours.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert [float(ours.state[p]["step"]) for p in model.parameters()] == [1.0] * 6
    model.to(memory_format=torch.contiguous_format)
    ours.step()
    theirs.step()
    for mine, q in zip(masters(ours, list(model.parameters())), ref.parameters()):
        assert rel_diff(mine, q) <= 1e-6
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_bf16_model_made_channels_last_after_a_step_steps_as_torch(mode, tmp_path):
    """A bf16 parameter keeps an fp32 master already: its layout may change, the master follows its elements."""
    model, ref, ours, theirs = _pair(mode, torch.bfloat16, tmp_path)
    gen = torch.Generator().manual_seed(1)
    for k in range(4):
        if k == 2:
            model.to(memory_format=torch.channels_last)
            ref.to(memory_format=torch.channels_last)
        _feed(model, ref, gen, torch.bfloat16)
        ours.step()
        theirs.step()
    assert not model[1].weight.is_contiguous()
    for p, mine, q in zip(model.parameters(), masters(ours, list(model.parameters())), ref.parameters()):
        assert rel_diff(mine, q) <= 1e-6
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_amsgrad_turned_on_in_a_later_group_is_refused_before_the_earlier_groups_step(mode, tmp_path):
    params = [torch.randn(50, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(3)]
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    opt = so.OffloadAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, offload=mode, **extra)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[1]["amsgrad"] = True
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="amsgrad"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == [1.0] * 3
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_amsgrad_turned_off_and_on_again_steps_as_torch(mode, tmp_path):
    """torch steps on without its running maximum and keeps it; turned on again, it goes on from it. nvme mode
    refused the step ("give the optimizer a new parameter") since its records hold the maximum; they keep it now,
    unread, as torch's state does. Over two chunks (small buffers), one of them in a second group."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).requires_grad_(True) for n in (30000, 50, 20000)]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    extra = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    ours = so.OffloadAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, amsgrad=True, offload=mode,
                           **extra)
    theirs = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:]}], lr=1e-2, amsgrad=True, foreach=False)
    for k, amsgrad in enumerate([True, True, False, False, True, True]):
        for opt in (ours, theirs):
            opt.param_groups[0]["amsgrad"] = amsgrad
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=gen) * (3.0 if k < 2 else 0.3)  # smaller later: the max matters
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for mine, q in zip(masters(ours, params), ref):
        assert rel_diff(mine, q) <= 1e-6
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    for i in theirs_sd["state"]:
        assert rel_diff(ours_sd["state"][i]["max_exp_avg_sq"], theirs_sd["state"][i]["max_exp_avg_sq"]) <= 1e-6
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_bf16_model_made_fp32_after_a_step_is_refused_in_both_modes(mode, tmp_path):
    """model.float() after a step: the parameter would be its own master, holding the bf16-rounded values. cpu
    mode stepped on from those, dropping the fp32 master silently (nvme mode refused, as the docs say); both
    refuse now, before anything is stepped, and go on as torch once the model is bf16 again."""
    model, ref, ours, theirs = _pair(mode, torch.bfloat16, tmp_path)
    gen = torch.Generator().manual_seed(1)
    _feed(model, ref, gen, torch.bfloat16)
    ours.step()
    theirs.step()
    model.float()
    _feed(model, ref, gen, torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="dtype"):
        ours.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    model.bfloat16()
    _feed(model, ref, gen, torch.bfloat16)
    ours.step()
    theirs.step()
    for p, mine, q in zip(model.parameters(), masters(ours, list(model.parameters())), ref.parameters()):
        assert rel_diff(mine, q) <= 1e-6
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))
    ours.close()
