"""SwapioTrainer with a resident model on a GPU and an optimizer updating it during backward (in_backward=True):
with max_grad_norm=0 Trainer still logs the gradient norm through accelerator.clip_grad_norm_(params, inf), which
rewrites every gradient (times 1), so the first step() refused it as a clip after the update. SwapioTrainer now
takes that norm without the rewrite (the same number), and refuses max_grad_norm > 0 and gradient accumulation
when it is built, as it does for an offloaded model. On CPU parameters in_backward=True changes nothing, and
nothing is refused. Run on the CPU against the simulated CUDA layer of tests/optim/test_optim_gpu_pipeline_simulated
(plain Trainer, which swapio cannot reach, still fails at its first step: docs/optim.md)."""
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.integrations.transformers import SwapioTrainer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "optim"))
from test_optim_gpu_pipeline_simulated import fake_gpu  # noqa: E402,F401 - the simulated GPU fixture


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)}


def _train(tmp_path, gpu, in_backward, max_grad_norm=0.0, accumulate=1, compute=None):
    model = Net()
    if gpu is not None:
        gpu.update(p.detach() for p in model.parameters())
    opt = so.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=in_backward)
    args = TrainingArguments(output_dir=str(tmp_path / f"out-{in_backward}"), max_steps=3, per_device_train_batch_size=4,
                             max_grad_norm=max_grad_norm, gradient_accumulation_steps=accumulate, report_to="none",
                             use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    try:
        trainer = SwapioTrainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched))
        trainer.train()
        if compute is not None:
            compute.run_until(len(compute.ops))
        norms = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
        return [p.detach().clone() for p in model.parameters()], norms
    finally:
        opt.close()


def test_max_grad_norm_0_logs_the_norm_without_refusing_the_step(fake_gpu, tmp_path):
    gpu, compute, _, _ = fake_gpu
    want, want_norms = _train(tmp_path, gpu, in_backward=False, compute=compute)
    got, norms = _train(tmp_path, gpu, in_backward=True, compute=compute)
    assert norms == want_norms and len(norms) == 3
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("what, kw", [("max_grad_norm", {"max_grad_norm": 1.0}),
                                      ("gradient_accumulation_steps", {"accumulate": 2})])
def test_clipping_and_accumulation_are_refused_when_the_trainer_is_built(fake_gpu, tmp_path, what, kw):
    gpu, _, _, _ = fake_gpu
    with pytest.raises(ValueError, match=rf"(?s){what}.*in_backward=True.*in_backward=False"):
        _train(tmp_path, gpu, in_backward=True, **kw)


def test_on_cpu_parameters_in_backward_changes_nothing(tmp_path):
    want, want_norms = _train(tmp_path, None, in_backward=False, max_grad_norm=1.0, accumulate=2)
    got, norms = _train(tmp_path, None, in_backward=True, max_grad_norm=1.0, accumulate=2)
    assert norms == want_norms
    assert all(torch.equal(p, q) for p, q in zip(got, want))
