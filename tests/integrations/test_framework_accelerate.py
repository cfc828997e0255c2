"""accelerate: prepare() takes OffloadAdamW like any optimizer; save_state()/load_state() resume bit-identically,
with the state in RAM or on disk."""
import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

import swapio.optim as so  # noqa: E402
from helpers.frameworks import assert_params_equal, mlp, mlp_batches, params_of  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _steps(accelerator, model, opt, sched, batches):
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


def _prepared(mode, swap_dir):
    accelerator = Accelerator(cpu=True)
    model = mlp()
    extra = {"swap_dir": swap_dir, "buffer_bytes": 3 << 16, "buffer_count": 3} if mode == "nvme" else {}
    opt = so.OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload=mode, **extra)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_accelerate_save_state_load_state_resume_bit_identically(mode, tmp_path):
    batches = mlp_batches(STEPS)
    accelerator, model, opt, sched = _prepared(mode, tmp_path)
    _steps(accelerator, model, opt, sched, batches[:SAVE_AT])
    accelerator.save_state(str(tmp_path / "state"))
    _steps(accelerator, model, opt, sched, batches[SAVE_AT:])
    full = params_of(model)
    opt.optimizer.close()

    accelerator, model, opt, sched = _prepared(mode, tmp_path)
    assert isinstance(opt.optimizer, so.OffloadAdamW)
    accelerator.load_state(str(tmp_path / "state"))
    assert sched.scheduler.last_epoch == SAVE_AT
    _steps(accelerator, model, opt, sched, batches[SAVE_AT:])
    assert_params_equal(params_of(model), full)

    ref_model = mlp()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for x, y in batches:
        torch.nn.functional.mse_loss(ref_model(x), y).backward()
        ref.step()
        ref_sched.step()
        ref.zero_grad()
    for k, v in params_of(ref_model).items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)
