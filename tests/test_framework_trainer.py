"""Hugging Face Trainer with optimizers=(OffloadAdamW(...), scheduler): trains like torch.optim.AdamW, and a run
resumed from a checkpoint ends bit-identical to an uninterrupted one, with the state in RAM or on disk."""
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup  # noqa: E402

import swapio.optim as so  # noqa: E402
from framework_helpers import TokenData, assert_params_equal, max_rel_diff, params_of, tiny_gpt2  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _train(out_dir, make_opt, resume=None, callbacks=None):
    """Trains the tiny GPT-2 for STEPS steps (checkpoint every SAVE_AT); returns (params, per-step losses)."""
    model = tiny_gpt2()
    opt = make_opt(model.parameters())
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, sched),
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    if hasattr(opt, "close"):
        opt.close()
    return params_of(model), losses


def _offload(mode, swap_dir):
    extra = {"swap_dir": swap_dir, "buffer_bytes": 3 << 16, "buffer_count": 3} if mode == "nvme" else {}
    return lambda params: so.OffloadAdamW(params, lr=1e-2, weight_decay=0.1, offload=mode, **extra)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_trainer_matches_torch_and_resumes_bit_identically(mode, tmp_path):
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    ref, ref_losses = _train(tmp_path / "torch",
                             lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False))
    full, losses = _train(tmp_path / "full", _offload(mode, swap_dir))
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    # float32 rounding, amplified by 6 steps through the model: torch's own fused AdamW differs from its
    # single-tensor AdamW by 1.5e-4 here (max |diff| / max |param| per tensor).
    assert max_rel_diff(full, ref) < 1e-3

    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed, resumed_losses = _train(tmp_path / "resumed", _offload(mode, swap_dir), resume=str(checkpoint))
    assert_params_equal(resumed, full)
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed_losses[step] == losses[step], step
    assert os.listdir(swap_dir) == []  # every optimizer removed its swap files


def test_streaming_checkpoint_callback_resumes_bit_identically(tmp_path):
    from swapio.integrations.transformers import StreamingCheckpointCallback
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    full, losses = _train(tmp_path / "full", _offload("nvme", swap_dir), callbacks=[StreamingCheckpointCallback()])
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    ref = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert ref == {"state": {}, "param_groups": [], "swapio_checkpoint": str(checkpoint / "swapio-optim")}
    assert (checkpoint / "swapio-optim" / "swapio-optim.pt").is_file()
    with pytest.raises(ValueError):  # another optimizer refuses the reference instead of loading nothing
        torch.optim.AdamW(tiny_gpt2().parameters()).load_state_dict(ref)

    resumed, resumed_losses = _train(tmp_path / "resumed", _offload("nvme", swap_dir), resume=str(checkpoint),
                                     callbacks=[StreamingCheckpointCallback()])
    assert_params_equal(resumed, full)
    assert all(resumed_losses[s] == losses[s] for s in range(SAVE_AT + 1, STEPS + 1))
    plain, _ = _train(tmp_path / "plain", _offload("nvme", swap_dir))  # the callback changes nothing else
    assert_params_equal(plain, full)
