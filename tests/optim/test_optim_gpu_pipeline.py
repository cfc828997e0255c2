"""A model on a GPU trained with OffloadAdamW(offload="cpu") through the asynchronous pipeline (gradients copied to
pinned RAM during backward, new values copied back on the side stream, optionally updated during backward):
each step's parameters, read on the compute stream as the next forward reads them, equal torch's AdamW fed the
same gradients. Skipped without CUDA (tests/optim/test_optim_gpu_pipeline_simulated.py runs the same logic on a
simulated GPU)."""
import pytest
import torch

import swapio.optim as so

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("habit", ["plain", "torch_clip", "opt_clip", "accumulate", "in_backward"])
def test_model_on_a_gpu_steps_like_torch(habit, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    model = model.to("cuda", dtype)
    # 64 KiB slots: 8192-element segments, so the weights take 32 segments through two staging buffers
    opt = so.OffloadAdamW(model.parameters(), lr=1e-3, offload="cpu", in_backward=habit == "in_backward",
                          buffer_bytes=4 << 16, buffer_count=4)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-3)
    x = torch.randn(64, 256, device="cuda", dtype=dtype)
    for step in range(5):
        for _ in range(2 if habit == "accumulate" else 1):
            model(x * (step + 1)).float().square().mean().backward()
        if habit == "torch_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        elif habit == "opt_clip":
            opt.clip_grad_norm_(0.01)
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        ref.step()
        for p, m in zip(model.parameters(), master):
            torch.testing.assert_close(opt.state[p]["master"], m.detach().cpu(), rtol=0, atol=1e-6)
            if dtype == torch.float32:
                torch.testing.assert_close(p.detach(), m.detach(), rtol=0, atol=1e-6)
            else:
                assert torch.equal(p.detach(), opt.state[p]["master"].to("cuda", dtype))  # arrived, rounded
        opt.zero_grad()
    opt.close()


@pytest.mark.parametrize("in_backward", [False, True])
def test_zero_grad_frees_the_gradients_at_once(in_backward):
    # The gradient copies must not hold the gradients (they did, through the next forward: GPU memory peaked one
    # fp32 copy of the gradients above torchao's).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
    x = torch.randn(16, 1024, device="cuda")
    model(x).square().mean().backward()  # cuBLAS's workspace and the like, allocated once
    model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated()
    opt = so.OffloadAdamW(model.parameters(), lr=1e-3, offload="cpu", in_backward=in_backward)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert torch.cuda.memory_allocated() <= base + (64 << 10)
    opt.close()
