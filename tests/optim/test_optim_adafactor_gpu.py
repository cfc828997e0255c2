"""OffloadAdafactor with parameters on a CUDA device: each parameter's gradient comes to the host whole, the CPU
steps the whole fp32 master, the new values go back in one copy; against torch.optim.Adafactor on fp32 CPU
copies, in both offload modes and with in_backward. Skipped without CUDA."""
import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, feed, masters, one_thread, ref_copy, rel_diff  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(7000,), (129, 65), (3, 40, 33), (600, 300)]  # 600x300 exceeds SMALL_BUFFERS' slots: kept whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_cuda_params_match_torch_adafactor_over_100_steps(mode, dtype, tmp_path):
    torch.manual_seed(0)
    params = [torch.randn(s, device="cuda").to(dtype).requires_grad_(True) for s in SHAPES]
    ref = ref_copy(params)
    ours = so.OffloadAdafactor(params, weight_decay=0.01, offload=mode, swap_dir=tmp_path, **SMALL_BUFFERS)
    theirs = torch.optim.Adafactor(ref, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        feed(params, ref, [torch.randn(s, generator=g) for s in SHAPES])
        ours.step()
        theirs.step()
    for p, mine, r in zip(params, masters(ours, params), ref):
        assert p.device.type == "cuda" and p.dtype == dtype
        assert rel_diff(mine, r) <= 1e-5
        assert torch.equal(p.detach().cpu(), mine.to(dtype))  # the parameter is the master rounded, and arrived
    ours.close()


def test_in_backward_equals_a_plain_step(tmp_path):
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
            for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [so.OffloadAdafactor(nets[0].parameters(), offload="cpu"),
            so.OffloadAdafactor(nets[1].parameters(), offload="cpu", in_backward=True)]
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g).cuda(), torch.randn(16, 8, generator=g).cuda()
        for net, opt in zip(nets, opts):
            (net(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)
    for opt in opts:
        opt.close()
