"""Edits of optimizer.param_groups between steps, as torch users make them (lr, betas, eps, weight_decay,
maximize, a tensor lr), against torch.optim.AdamW fed the same gradients; amsgrad turned on mid-run, which
torch cannot do either (its step raises KeyError), fails loudly everywhere, and turning it back off recovers."""
import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, masters, one_thread, rel_diff  # noqa: F401

MODES = ["cpu", "nvme"]
EDITS = [{}, {"lr": 3e-3}, {"betas": (0.5, 0.9)}, {"weight_decay": 0.3}, {"eps": 1e-3}, {"maximize": True},
         {"maximize": False}, {"betas": (torch.tensor(0.7), torch.tensor(0.8))}, {"lr": torch.tensor(2e-3)}]


def _pair(mode, tmp_path, **kw):
    params = [torch.randn(300, requires_grad=True), torch.randn(20, 30).bfloat16().requires_grad_(True)]
    ref = [p.detach().float().clone().requires_grad_(True) for p in params]
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    return params, ref, so.OffloadAdamW(params, lr=1e-2, offload=mode, **kw, **extra), \
        torch.optim.AdamW(ref, lr=1e-2, foreach=False, **kw)


def _feed(params, ref, gen):
    for p, q in zip(params, ref):
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        q.grad = p.grad.float()


@pytest.mark.parametrize("mode", MODES)
def test_group_edits_between_steps_step_as_torch(mode, tmp_path):
    params, ref, ours, theirs = _pair(mode, tmp_path)
    gen = torch.Generator().manual_seed(1)
    for edit in EDITS:
        for opt in (ours, theirs):
            opt.param_groups[0].update(edit)
        _feed(params, ref, gen)
        ours.step()
        theirs.step()
    for mine, q in zip(masters(ours, params), ref):
        assert rel_diff(mine, q) <= 1e-6
    ours.close()


@pytest.mark.parametrize("mode", MODES)
def test_amsgrad_turned_on_mid_run_fails_loudly_and_turned_off_again_goes_on(mode, tmp_path):
    params, ref, ours, theirs = _pair(mode, tmp_path)
    gen = torch.Generator().manual_seed(1)
    _feed(params, ref, gen)
    ours.step()
    theirs.step()
    for opt in (ours, theirs):
        opt.param_groups[0]["amsgrad"] = True
    _feed(params, ref, gen)
    with pytest.raises(KeyError):
        theirs.step()  # torch cannot either
    with pytest.raises(RuntimeError, match="amsgrad"):
        ours.step()
    # exporting what was trained must not fail with a bare KeyError: it names the edit and the way back
    with pytest.raises(RuntimeError, match="amsgrad"):
        ours.state_dict()
    with pytest.raises(RuntimeError, match="amsgrad"):
        ours.save(tmp_path / "ckpt")
    for opt in (ours, theirs):
        opt.param_groups[0]["amsgrad"] = False
    theirs_sd, ours_sd = theirs.state_dict(), ours.state_dict()  # nothing was stepped by the refused step
    for i in theirs_sd["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert rel_diff(ours_sd["state"][i][key], theirs_sd["state"][i][key]) <= 1e-6, key
    ours.step()
    theirs.step()
    for mine, q in zip(masters(ours, params), ref):
        assert rel_diff(mine, q) <= 1e-6
    ours.save(tmp_path / "ckpt")
    ours.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("edit, named", [({"lr": -1e-3}, "learning rate"), ({"betas": (0.9, 1.5)}, "beta"),
                                         ({"eps": float("nan")}, "epsilon")])
def test_a_group_edited_to_an_invalid_value_is_refused_at_step_naming_the_group_before_any_change(mode, edit, named,
                                                                                                  tmp_path):
    """A custom LambdaLR that goes negative past its end: torch would step with it silently (gradient ascent); the
    step refuses it, naming the group and where such a value comes from, and changes nothing."""
    params, ref, ours, _ = _pair(mode, tmp_path)
    ours.add_param_group({"params": [torch.randn(40, requires_grad=True)]})
    gen = torch.Generator().manual_seed(1)
    _feed(params, ref, gen)
    ours.step()
    before = [p.detach().clone() for p in params]
    steps = [float(ours.state[p]["step"]) for p in params]
    ours.param_groups[1].update(edit)
    _feed(params, ref, gen)
    ours.param_groups[1]["params"][0].grad = torch.randn(40)
    with pytest.raises(ValueError, match=rf"param group 1: Invalid {named}.*lr scheduler"):
        ours.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(ours.state[p]["step"]) for p in params] == steps
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("where", ["same group", "another group"])
def test_a_parameter_listed_twice_by_editing_a_group_is_refused_before_any_change(where, mode, tmp_path):
    """add_param_group refuses a parameter listed twice, but appending to a group's list bypassed it: such a
    parameter was updated once per listing but counted once a step (torch counts each), silently.
    step(), state_dict() and save() now refuse it, naming the positions, before anything is stepped."""
    params = [torch.randn(300, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(3)]
    extra = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    opt = so.OffloadAdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], lr=1e-2, offload=mode,
                          **extra)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    group = opt.param_groups[0 if where == "same group" else 1]
    group["params"].append(params[0])
    listed = 2 if where == "same group" else 1
    for call in (opt.step, opt.state_dict, lambda: opt.save(tmp_path / "ckpt")):
        with pytest.raises(ValueError, match=rf"position {listed} a parameter already listed \(group 0, position 0\)"):
            call()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == [1.0] * 3
    group["params"].pop()
    opt.step()  # listed once again: on as before
    assert [float(opt.state[p]["step"]) for p in params] == [2.0] * 3
    opt.close()
