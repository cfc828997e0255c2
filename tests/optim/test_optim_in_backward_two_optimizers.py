"""GPU parameters given to a second swapio optimizer while one built with in_backward=True still lives (a new
optimizer for the next phase, the old one still referenced by a scheduler or a variable): the old one's hooks
updated them at every backward beside the new one's steps, silently (its second backward then failed naming a
second backward or retain_graph). Now the second optimizer is refused at construction, naming close(); once the
old one is closed, or dropped and collected, the new one trains exactly as torch's AdamW started at that point.
Run on the CPU against the simulated CUDA layer of test_optim_gpu_pipeline_simulated."""
import gc

import pytest
import torch

import swapio
from test_optim_gpu_pipeline_simulated import (  # noqa: F401 - fake_gpu: the simulated GPU fixture
    _loss, _model, _steps_match_torch, fake_gpu)


def _on_gpu(gpu):
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    return model


def _first_phase(model, compute, in_backward):
    old = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=in_backward)
    _loss(model, 0).backward()
    old.step()
    old.zero_grad()
    compute.run_until(len(compute.ops))
    return old


def _second_phase_matches_torch(model, compute, new):
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    _steps_match_torch(model, compute, new, ref, torch.optim.AdamW(ref, lr=1e-3), range(1, 4))
    new.close()


@pytest.mark.parametrize("mode, in_backward", [("cpu", True), ("cpu", False), ("nvme", False)])
def test_a_second_optimizer_is_refused_while_an_in_backward_one_lives(fake_gpu, tmp_path, mode, in_backward):
    gpu, compute, _, _ = fake_gpu
    model = _on_gpu(gpu)
    old = _first_phase(model, compute, in_backward=True)
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    make = lambda: swapio.optim.OffloadAdamW(model.parameters(), lr=1e-3, offload=mode, in_backward=in_backward,
                                             **extra)
    with pytest.raises(ValueError, match=r"(?s)parameter 0 .*in_backward=True and still alive.*close\(\)"):
        make()
    assert all(float(old.state[p]["step"]) == 1 for p in model.parameters())
    old.close()
    _second_phase_matches_torch(model, compute, make())


def test_an_in_backward_optimizer_dropped_and_collected_frees_its_parameters(fake_gpu):
    gpu, compute, _, _ = fake_gpu
    model = _on_gpu(gpu)
    _first_phase(model, compute, in_backward=True)
    gc.collect()
    new = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-3, offload="cpu", in_backward=True)
    _second_phase_matches_torch(model, compute, new)


def test_an_optimizer_without_in_backward_does_not_claim_its_parameters(fake_gpu):
    """Its hooks only copy gradients (its steps are step()'s), so a second optimizer may take them, as in torch."""
    gpu, compute, _, _ = fake_gpu
    model = _on_gpu(gpu)
    old = _first_phase(model, compute, in_backward=False)
    new = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-3, offload="cpu", in_backward=True)
    _second_phase_matches_torch(model, compute, new)
    assert all(float(old.state[p]["step"]) == 1 for p in model.parameters())
    old.close()
