"""A gradient of another dtype than its parameter: torch 2.13's `p.grad_dtype` lets a bf16 parameter keep fp32
gradients (and the reverse), which torch's own AdamW then refuses. The offloaded step reads the gradient as it is, in
fp32: the same as torch.optim.AdamW stepping the fp32 master with that gradient."""
import pytest
import torch

import swapio.optim as so
from helpers.optim import masters, one_thread  # noqa: F401


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("param_dtype, grad_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                     (torch.float32, torch.bfloat16)])
def test_a_gradient_of_another_dtype_steps_as_torch_on_the_fp32_master(param_dtype, grad_dtype, mode, tmp_path):
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch's fused CPU AdamW uses fused multiply-adds only in its AVX2/AVX-512 builds")
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(1000, generator=gen).to(param_dtype).requires_grad_(True)
    p.grad_dtype = grad_dtype
    ref = p.detach().float().requires_grad_(True)
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    ours = so.OffloadAdamW([p], lr=1e-2, offload=mode, **extra)
    theirs = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    for _ in range(3):
        p.grad = torch.randn(1000, generator=gen).to(grad_dtype)
        ref.grad = p.grad.float()
        ours.step()
        theirs.step()
    assert torch.equal(masters(ours, [p])[0], ref.detach())
    assert torch.equal(p.detach(), ref.detach().to(param_dtype))
    ours.close()
