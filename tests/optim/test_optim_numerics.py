"""OffloadAdam/OffloadAdamW against torch.optim.Adam/AdamW (foreach=False) over 100 steps.

Reference: torch updates an fp32 master copy with grad.float(); we compare our fp32 master weights.
"""
import pytest
import torch

from helpers.optim import SMALL_BUFFERS, TOL, feed, make_opts, masters, one_thread, ref_copy, rel_diff  # noqa: F401

STEPS = 100
MODES = ["cpu", "nvme"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
CLASSES = ["AdamW", "Adam"]


def _mlp(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model.to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_mlp_matches_torch_over_100_steps_with_groups_and_scheduler(mode, dtype, cls_name, tmp_path):
    model = _mlp(dtype)
    params = list(model.parameters())
    ref = ref_copy(params)
    ours, torch_opt = make_opts(cls_name, params, ref, split=4, mode=mode, swap_dir=tmp_path, wd=0.1)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-5) for o in (ours, torch_opt)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    for _ in range(STEPS):
        ours.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        feed(params, ref, [p.grad for p in params])
        ours.step()
        torch_opt.step()
        for s in scheds:
            s.step()
    for mine, theirs in zip(masters(ours, params), ref):
        assert rel_diff(mine, theirs) <= TOL
    if dtype != torch.float32:  # the parameter is the master rounded to its dtype
        for p, m in zip(params, masters(ours, params)):
            assert torch.equal(p.detach(), m.to(dtype))
    ours.close()


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", CLASSES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_random_tensors_match_torch_over_100_steps(mode, dtype, cls_name, tmp_path):
    """Odd sizes spanning several 64 KiB chunks (nvme), weight decay on in one group and off in the other,
    and a OneCycleLR that also moves beta1 every step."""
    torch.manual_seed(2)
    shapes = [(7000,), (3,), (129, 65), (1,), (20011,)]
    params = [torch.randn(s).to(dtype).requires_grad_(True) for s in shapes]
    ref = ref_copy(params)
    ours, torch_opt = make_opts(cls_name, params, ref, split=2, mode=mode, swap_dir=tmp_path, wd=0.2,
                                ours_kwargs=SMALL_BUFFERS)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 5e-3], total_steps=STEPS) for o in
              (ours, torch_opt)]
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        feed(params, ref, [torch.randn(s, generator=g) for s in shapes])
        ours.step()
        torch_opt.step()
        for s in scheds:
            s.step()
    for mine, theirs in zip(masters(ours, params), ref):
        assert rel_diff(mine, theirs) <= TOL
    ours.close()


@pytest.mark.parametrize("mode", MODES)
def test_amsgrad_and_maximize_match_torch(mode, tmp_path):
    torch.manual_seed(4)
    params = [torch.randn(3000, requires_grad=True), torch.randn(40, 30, requires_grad=True)]
    ref = ref_copy(params)
    ours, torch_opt = make_opts("AdamW", params, ref, split=1, mode=mode, swap_dir=tmp_path, amsgrad=True,
                                maximize=True, ours_kwargs=SMALL_BUFFERS)
    g = torch.Generator().manual_seed(5)
    for _ in range(30):
        feed(params, ref, [torch.randn(p.shape, generator=g) for p in params])
        ours.step()
        torch_opt.step()
    for mine, theirs in zip(masters(ours, params), ref):
        assert rel_diff(mine, theirs) <= TOL
    sd = ours.state_dict()
    for i, q in enumerate(ref):
        assert rel_diff(sd["state"][i]["max_exp_avg_sq"], torch_opt.state[q]["max_exp_avg_sq"]) <= TOL
    ours.close()


@pytest.mark.parametrize("mode", MODES)
def test_fp16_and_non_contiguous_params_match_torch(mode, tmp_path):
    torch.manual_seed(6)
    params = [torch.randn(300, 20).half().requires_grad_(True),
              torch.randn(40, 90).t().detach().requires_grad_(True),       # fp32, non-contiguous
              torch.randn(70, 50).bfloat16().t().detach().requires_grad_(True)]  # bf16, non-contiguous
    ref = ref_copy(params)
    ours, torch_opt = make_opts("AdamW", params, ref, split=1, mode=mode, swap_dir=tmp_path,
                                ours_kwargs=SMALL_BUFFERS)
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        feed(params, ref, [torch.randn(p.shape, generator=g) for p in params])
        ours.step()
        torch_opt.step()
    for p, mine, theirs in zip(params, masters(ours, params), ref):
        assert rel_diff(mine, theirs) <= TOL
        assert torch.equal(p.detach(), mine.to(p.dtype))
    ours.close()


@pytest.mark.parametrize("mode", MODES)
def test_param_group_added_after_steps(mode, tmp_path):
    torch.manual_seed(8)
    a, b = torch.randn(5000, requires_grad=True), torch.randn(9000).bfloat16().requires_grad_(True)
    (ra,), (rb,) = ref_copy([a]), ref_copy([b])
    kwargs = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    import swapio.optim as so
    ours = so.OffloadAdamW([a], lr=1e-2, offload=mode, **kwargs)
    torch_opt = torch.optim.AdamW([ra], lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(9)
    for step in range(12):
        if step == 5:
            ours.add_param_group({"params": [b], "lr": 3e-3, "weight_decay": 0.0})
            torch_opt.add_param_group({"params": [rb], "lr": 3e-3, "weight_decay": 0.0})
        grads = [torch.randn(5000, generator=g), torch.randn(9000, generator=g) if step >= 5 else None]
        feed([a, b], [ra, rb], grads)
        ours.step()
        torch_opt.step()
    for mine, theirs in zip(masters(ours, [a, b]), [ra, rb]):
        assert rel_diff(mine, theirs) <= TOL
    ours.close()
