"""torch.amp.GradScaler with in_backward=True on GPU parameters: backward updates each parameter with the scaled
gradient before the scaler can unscale it or skip a step whose gradients hold an inf. A skipped step used to be
silently not skipped (NaN weights while the scaler backed off, step() never called to refuse it); now
scaler.step() always reaches step(), which refuses the scaler, naming in_backward=False. Run on the CPU against
the simulated CUDA layer of test_optim_gpu_pipeline_simulated (and on a real GPU where there is one). The
combinations the scaler does serve (in_backward=False on the GPU, in_backward=True on CPU parameters, which it
leaves to step()) go on exactly as torch's AdamW with the same scaler."""
import pytest
import torch

import swapio
from test_optim_gpu_pipeline_simulated import _loss, _model, fake_gpu  # noqa: F401 - the simulated GPU fixture

SCALER = {"init_scale": 2.0 ** 10}


def _scaled_step(model, opt, scaler, i, inf=False, unscale=False):
    loss = _loss(model, i)
    scaler.scale(loss * float("inf") if inf else loss).backward()
    if unscale:
        scaler.unscale_(opt)
    return scaler.step(opt)


@pytest.mark.parametrize("inf, unscale", [(True, False), (False, False), (True, True)],
                         ids=["skipped", "stepped", "unscaled_first"])
def test_grad_scaler_is_refused_with_in_backward_gpu_parameters(fake_gpu, inf, unscale):
    gpu, compute, _, _ = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    with pytest.raises(RuntimeError, match=r"(?s)GradScaler.*in_backward=True.*in_backward=False") as info:
        _scaled_step(model, opt, scaler, 0, inf=inf, unscale=unscale)
    assert "bfloat16" in str(info.value)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")  # a plain step() is not refused after
    opt.zero_grad()  # the optimizer goes on without the scaler
    _loss(model, 1).backward()
    opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
    opt.close()


def _scaled_run(model, opt, compute=None, steps=4, inf_at=(1,)):
    """Scaled steps, an inf in the loss at inf_at; compute: the simulated GPU's stream, run before each forward.
    Returns the scaler's scale at the end."""
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    for i in range(steps):
        _scaled_step(model, opt, scaler, i, inf=i in inf_at)
        scaler.update()
        opt.zero_grad()
        if compute is not None:
            compute.run_until(len(compute.ops))  # the next forward's turn on the GPU
    return scaler.get_scale()


def test_grad_scaler_with_in_backward_false_on_gpu_parameters_skips_as_torch(fake_gpu):
    gpu, compute, _, _ = fake_gpu
    model, ref = _model(torch.float32), _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu")
    scale = _scaled_run(model, opt, compute)
    assert _scaled_run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)) == scale == 2.0 ** 9
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    opt.close()


def test_grad_scaler_with_in_backward_on_cpu_parameters_steps_as_torch():
    """in_backward=True updates GPU parameters and offloaded weights during backward; CPU parameters are stepped by
    step(), where the scaler's unscaling and skipping work: bit for bit torch's fused AdamW with the same scaler."""
    model, ref = _model(torch.float32), _model(torch.float32)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    assert _scaled_run(model, opt) == _scaled_run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grad_scaler_is_refused_with_in_backward_on_a_real_gpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    scaler = torch.amp.GradScaler("cuda", **SCALER)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(4, 64, device="cuda")).float().square().mean() * float("inf")
    scaler.scale(loss).backward()
    with pytest.raises(RuntimeError, match="GradScaler.*in_backward=False"):
        scaler.step(opt)
    opt.close()
