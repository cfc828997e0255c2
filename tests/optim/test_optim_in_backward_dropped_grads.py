"""in_backward=True on GPU parameters, a gradient dropped between backward and step() (`p.grad = None` to freeze a
layer for this step, as DINO's cancel_gradients_last_layer does; model.zero_grad()): the worker stepped each
parameter with p.grad as it found it, so whether a dropped one was updated depended on whether the worker had
reached it yet, and step() raised nothing either way (torch's step() skips it). Now each update uses the gradient
backward produced, every parameter backward handed over is updated (as for offloaded weights), and step() refuses
the dropped gradient, naming in_backward=False. Run on the CPU against the simulated CUDA layer of
test_optim_gpu_pipeline_simulated; the worker is held with a gate until the caller has dropped the gradient."""
import threading

import pytest
import torch

import swapio
from test_optim_gpu_pipeline_simulated import (  # noqa: F401 - fake_gpu: the simulated GPU fixture
    _loss, _model, _steps_match_torch, fake_gpu)


def _drop(model, how):
    if how == "last_layer":
        for p in model[-1].parameters():
            p.grad = None
    else:
        model.zero_grad()


@pytest.mark.parametrize("how", ["last_layer", "model_zero_grad"])
@pytest.mark.parametrize("worker", ["held", "done"])
def test_a_gradient_dropped_after_backward_is_refused_and_every_update_ran(fake_gpu, worker, how):
    gpu, compute, _, _ = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    gate = threading.Event()
    real_step = opt._gpu_in_backward._step_params
    opt._gpu_in_backward._step_params = lambda params, copies: (gate.wait(), real_step(params, copies))
    if worker == "done":
        gate.set()
    _loss(model, 0).backward()
    for r, p in zip(ref, model.parameters()):
        r.grad = p.grad.clone()
    if worker == "done":
        opt.state_dict()  # waits for the worker: every update has run
    _drop(model, how)
    gate.set()
    with pytest.raises(RuntimeError, match=r"(?s)dropped.*in_backward=True.*in_backward=False"):
        opt.step()
    # what ran is the whole step backward handed over: torch's AdamW with every gradient
    ref_opt.step()
    opt.zero_grad()
    compute.run_until(len(compute.ops))
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-6)
    _steps_match_torch(model, compute, opt, ref, ref_opt, range(1, 3))  # and training goes on as torch's
    opt.close()
