"""OffloadAdamW with parameters on a CUDA device: grads come to pinned host memory, the CPU steps the fp32 master,
and the updated values go back with non_blocking copies that step() synchronises. Skipped without CUDA."""
import copy

import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, TOL, feed, make_opts, masters, one_thread, ref_copy, rel_diff  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES = ["cpu", "nvme"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_params_match_torch_over_100_steps(mode, dtype, tmp_path):
    torch.manual_seed(0)
    shapes = [(7000,), (3,), (129, 65), (20011,)]
    params = [torch.randn(s, device="cuda").to(dtype).requires_grad_(True) for s in shapes]
    ref = ref_copy(params)
    ours, torch_opt = make_opts("AdamW", params, ref, split=2, mode=mode, swap_dir=tmp_path, wd=0.1,
                                ours_kwargs=SMALL_BUFFERS)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=100) for o in (ours, torch_opt)]
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        feed(params, ref, [torch.randn(s, generator=g) for s in shapes])
        ours.step()
        torch_opt.step()
        for s in scheds:
            s.step()
    for p, mine, theirs in zip(params, masters(ours, params), ref):
        assert p.device.type == "cuda" and p.dtype == dtype
        assert rel_diff(mine, theirs) <= TOL
        assert torch.equal(p.detach().cpu(), mine.to(dtype))  # the parameter is the master rounded, and it arrived
    ours.close()


@pytest.mark.parametrize("mode", MODES)
def test_cuda_non_contiguous_param_and_resume(mode, tmp_path):
    torch.manual_seed(2)
    params = [torch.randn(300, 70, device="cuda").bfloat16().t().detach().requires_grad_(True),
              torch.randn(5000, device="cuda", requires_grad=True)]
    opt = so.OffloadAdamW(params, offload=mode, swap_dir=tmp_path, **SMALL_BUFFERS)
    g = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(6)]
    for gs in grads[:3]:
        for p, x in zip(params, gs):
            p.grad = x.to(p)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # cpu mode returns the live state, like torch
    saved = [p.detach().clone() for p in params]
    for gs in grads[3:]:
        for p, x in zip(params, gs):
            p.grad = x.to(p)
        opt.step()
    resumed = [s.clone().requires_grad_(True) for s in saved]
    other = so.OffloadAdamW(resumed, offload=mode, swap_dir=tmp_path, **SMALL_BUFFERS)
    other.load_state_dict(sd)
    for gs in grads[3:]:
        for p, x in zip(resumed, gs):
            p.grad = x.to(p)
        other.step()
    for p, q in zip(params, resumed):
        assert torch.equal(p.detach(), q.detach())
    opt.close()
    other.close()
