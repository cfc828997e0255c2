"""Hugging Face Trainer with OffloadAdafactor given as optimizer_cls_and_kwargs: trains like
torch.optim.Adafactor given the same way, and a run resumed from a streaming checkpoint ends bit-identical."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

import swapio.optim as so  # noqa: E402
from helpers.frameworks import TokenData, assert_params_equal, max_rel_diff, params_of, tiny_gpt2  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _train(out_dir, cls, kwargs, resume=None, callbacks=None):
    model = tiny_gpt2()
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=callbacks,
                      optimizer_cls_and_kwargs=(cls, kwargs))
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if hasattr(opt, "close"):
        opt.close()
    return params_of(model), losses


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_trainer_matches_torch_adafactor_and_resumes_bit_identically(offload, tmp_path):
    from swapio.integrations.transformers import StreamingCheckpointCallback
    swap = tmp_path / "swap"
    swap.mkdir()
    ours = dict(lr=1e-2, weight_decay=0.01, offload=offload, swap_dir=swap, buffer_bytes=3 << 16, buffer_count=3)
    ref, ref_losses = _train(tmp_path / "torch", torch.optim.Adafactor, dict(lr=1e-2, weight_decay=0.01))
    full, losses = _train(tmp_path / "full", so.OffloadAdafactor, ours, callbacks=[StreamingCheckpointCallback()])
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert max_rel_diff(full, ref) < 1e-4  # float32 rounding, amplified by 6 steps through the model
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    assert "swapio_checkpoint" in torch.load(checkpoint / "optimizer.pt", weights_only=True)
    resumed, resumed_losses = _train(tmp_path / "resumed", so.OffloadAdafactor, ours, resume=str(checkpoint),
                                     callbacks=[StreamingCheckpointCallback()])
    assert_params_equal(resumed, full)
    assert all(resumed_losses[s] == losses[s] for s in range(SAVE_AT + 1, STEPS + 1))
