"""accelerate's loss scaling with swapio's optimizers: a GradScaler on the Accelerator (what fp16 mixed precision
installs on a GPU; accelerate installs none on the CPU, so the test sets one) scales the loss in
accelerator.backward, unscales in clip_grad_norm_, and skips the optimizer's step when a gradient is not finite.
accelerator.optimizer_step_was_skipped, the scheduler (which does not step then) and the weights follow torch's
AdamW (its single-tensor implementation: the fused one checks the gradients itself, so accelerate never sees
its step skipped) step for step. An offloaded model cannot be unscaled: a RuntimeError naming bf16 autocast."""
import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, remove_offload  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _accelerator(gas=1):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gas)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    return accelerator


def _run(make_opt, gas, overflow_at):
    accelerator = _accelerator(gas)
    model = _net()
    opt = make_opt(model.parameters())
    scheduler = transformers.get_scheduler("linear", optimizer=opt, num_warmup_steps=2, num_training_steps=20)
    model, opt, scheduler = accelerator.prepare(model, opt, scheduler)
    g = torch.Generator().manual_seed(5)
    skipped, lrs = [], []
    for i in range(8):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        if i in overflow_at:
            x = x * float("inf")
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            scheduler.step()
            opt.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        lrs.append(opt.param_groups[0]["lr"])
    with torch.no_grad():
        out = model(torch.ones(2, 8))
    if hasattr(opt.optimizer, "close"):
        opt.optimizer.close()
    return out, skipped, lrs


@pytest.mark.parametrize("overflow_at", [(), (3,), (2, 5)], ids=["none", "one", "two"])
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_skipped_steps_follow_torch(mode, gas, overflow_at, tmp_path):
    extra = {"swap_dir": tmp_path / "swap"} if mode == "nvme" else {}
    out, skipped, lrs = _run(lambda ps: so.OffloadAdamW(ps, lr=1e-2, offload=mode, **extra), gas, overflow_at)
    want_out, want_skipped, want_lrs = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False), gas,
                                            overflow_at)
    assert skipped == want_skipped and any(skipped) == bool(overflow_at)
    assert lrs == want_lrs
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)


def test_an_offloaded_model_cannot_be_unscaled():
    accelerator = _accelerator()
    model = cpu_offload(_net())
    model, opt = accelerator.prepare(model, so.OffloadAdamW(model.parameters(), lr=1e-2))
    accelerator.backward(model(torch.ones(2, 8)).square().mean())
    with pytest.raises(RuntimeError, match=r"GradScaler(.|\n)*bfloat16"):
        opt.step()
    opt.optimizer.close()
    remove_offload(model)
