"""swapio.optim.OffloadAdafactor against torch.optim.Adafactor: 100 steps on 1-D, 2-D and >= 3-D parameters in
both offload modes, fp32 and bf16 parameters, param groups, lr schedulers, closures; its defaults and checks."""
import pytest
import torch

so = pytest.importorskip("swapio.optim", reason="swapio is not built (python setup.py build_ext --inplace)")
from helpers.optim import SMALL_BUFFERS, feed, masters, one_thread, rel_diff  # noqa: E402,F401

SHAPES = [(37,), (24, 40), (3, 5, 33), (2, 2, 3, 17), (300, 70)]  # 300x70 spans SMALL_BUFFERS' 64 KiB slots


def params_of(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def run_side_by_side(ours_params, ref_params, ours, ref, steps, seed=1, sched=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        feed(ours_params, ref_params, [torch.randn(p.shape, generator=gen) for p in ours_params])
        ours.step()
        ref.step()
        for s in sched or ():
            s.step()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hundred_steps_match_torch_adafactor(offload, dtype, tmp_path):
    ours_params = params_of(dtype)
    ref_params = [p.detach().float().clone().requires_grad_(True) for p in ours_params]
    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.03, "weight_decay": 0.1, "d": 2.0}]
    ours = so.OffloadAdafactor(groups(ours_params), offload=offload, swap_dir=tmp_path, weight_decay=0.01,
                               **SMALL_BUFFERS)
    ref = torch.optim.Adafactor(groups(ref_params), weight_decay=0.01)
    run_side_by_side(ours_params, ref_params, ours, ref, 100)
    for mine, theirs in zip(masters(ours, ours_params), ref_params):
        assert rel_diff(mine, theirs) < 1e-5
    state = ours.state_dict()["state"]
    for i, p in enumerate(ref_params):
        for name, value in ref.state[p].items():
            assert state[i][name].shape == value.shape, name
            torch.testing.assert_close(state[i][name], value, rtol=1e-5, atol=1e-12)
    ours.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_lr_scheduler_maximize_and_closure_as_torch(offload, tmp_path):
    ours_params = params_of(torch.float32, seed=3)
    ref_params = [p.detach().clone().requires_grad_(True) for p in ours_params]
    ours = so.OffloadAdafactor(ours_params, lr=0.02, maximize=True, eps=(1e-4, 1e-2), beta2_decay=-0.6,
                               offload=offload, swap_dir=tmp_path)
    ref = torch.optim.Adafactor(ref_params, lr=0.02, maximize=True, eps=(1e-4, 1e-2), beta2_decay=-0.6)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5) for o in (ours, ref)]
    run_side_by_side(ours_params, ref_params, ours, ref, 30, sched=scheds)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    for mine, theirs in zip(ours_params, ref_params):
        assert rel_diff(mine, theirs) < 1e-5
    loss = ours.step(closure=lambda: torch.tensor(3.0))
    assert float(loss) == 3.0
    ours.close()


def test_defaults_are_torchs_and_bad_hyperparameters_raise_at_construction():
    p = [torch.zeros(3, 4, requires_grad=True)]
    opt = so.OffloadAdafactor(p)
    ref = torch.optim.Adafactor([torch.zeros(3, 4, requires_grad=True)])
    for key in ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize", "foreach"):
        assert opt.param_groups[0][key] == ref.param_groups[0][key], key
    for bad in (dict(lr=-1.0), dict(beta2_decay=0.5), dict(eps=(-1.0, 1e-3)), dict(eps=(None, -1.0)),
                dict(eps=1e-3), dict(d=0.5), dict(weight_decay=-0.1), dict(offload="disk")):
        with pytest.raises(ValueError):
            so.OffloadAdafactor(p, **bad)
    with pytest.raises(ValueError, match="fp32 state only"):
        so.OffloadAdafactor(p, state_dtype="int8")
    with pytest.raises(ValueError, match="d should be >= 1"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "d": 0.1})


def test_a_parameter_changed_outside_is_adopted_as_with_torch(tmp_path):
    """bf16 parameter edited in place between steps: the master takes the new values (as OffloadAdamW does)."""
    p = torch.randn(8, 12).to(torch.bfloat16).requires_grad_(True)
    opt = so.OffloadAdafactor([p], offload="nvme", swap_dir=tmp_path)
    p.grad = torch.randn(8, 12).to(torch.bfloat16)
    opt.step()
    with torch.no_grad():
        p.fill_(0.5)
    with pytest.warns(Warning, match="changed outside"):
        opt.step()
    master = opt.state_dict()["state"][0]["master"]
    assert (master - 0.5).abs().max() < 0.1  # one small step away from the adopted 0.5
    opt.close()


def test_sharded_parameter_is_refused_naming_the_reason():
    """A DTensor's local shard (what the family steps for FSDP2) is not the whole parameter Adafactor's norms need.
    Stand-in: the attribute by which swapio recognises a DTensor (params.shard); a real one needs a process group
    (tests/integrations/test_framework_distributed.py)."""
    p = torch.zeros(4, 6, requires_grad=True)
    p._local_tensor = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="DTensor"):
        so.OffloadAdafactor([p])
    opt = so.OffloadAdafactor([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match="DTensor"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_non_contiguous_parameter_is_factored_by_its_logical_shape(offload, tmp_path):
    """A transposed view: its rows and columns are the logical ones (a contiguous temporary of that shape)."""
    base = torch.randn(40, 24)
    p = base.t().requires_grad_(True)  # (24, 40), not contiguous
    assert not p.is_contiguous()
    ref = p.detach().clone().requires_grad_(True)
    ours = so.OffloadAdafactor([p], offload=offload, swap_dir=tmp_path)
    theirs = torch.optim.Adafactor([ref])
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        g = torch.randn(24, 40, generator=gen)
        p.grad, ref.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert rel_diff(p, ref) < 1e-5
    assert ours.state_dict()["state"][0]["row_var"].shape == (24, 1)
    ours.close()
