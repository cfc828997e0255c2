"""Hugging Face Trainer with optimizers=(OffloadAdamW(...), scheduler): trains like torch.optim.AdamW, and a run
resumed from a checkpoint ends bit-identical to an uninterrupted one, with the state in RAM or on disk."""
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.optim import reference  # noqa: E402
from helpers.frameworks import TokenData, assert_params_equal, max_rel_diff, params_of, tiny_gpt2  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _train(out_dir, make_opt, resume=None, callbacks=None, trainer_cls=Trainer):
    """Trains the tiny GPT-2 for STEPS steps (checkpoint every SAVE_AT); returns (params, per-step losses)."""
    model = tiny_gpt2()
    opt = make_opt(model.parameters())
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = trainer_cls(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, sched),
                          callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    if hasattr(opt, "close"):
        opt.close()
    return params_of(model), losses


def _offload(mode, swap_dir):
    extra = {"swap_dir": swap_dir, "buffer_bytes": 3 << 16, "buffer_count": 3} if mode == "nvme" else {}
    return lambda params: so.OffloadAdamW(params, lr=1e-2, weight_decay=0.1, offload=mode, **extra)


@pytest.mark.slow
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


@pytest.mark.slow
def test_streaming_checkpoint_callback_resumes_bit_identically(tmp_path):
    from swapio.integrations.transformers import StreamingCheckpointCallback
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    full, losses = _train(tmp_path / "full", _offload("nvme", swap_dir), callbacks=[StreamingCheckpointCallback()])
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    ref = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    identity = ref.pop("swapio_checkpoint_identity")  # of the file written: a rewritten one is refused on resume
    assert identity[1] == os.stat(checkpoint / "swapio-optim" / "swapio-optim.safetensors").st_ino
    header = ref.pop("swapio_checkpoint_header")  # and of its content (a copy of it resumes)
    assert header == reference.header_digest(checkpoint / "swapio-optim" / "swapio-optim.safetensors")
    assert ref == {"state": {}, "param_groups": [], "swapio_checkpoint": str(checkpoint / "swapio-optim")}
    assert (checkpoint / "swapio-optim" / "swapio-optim.safetensors").is_file()
    with pytest.raises(ValueError):  # another optimizer refuses the reference instead of loading nothing
        torch.optim.AdamW(tiny_gpt2().parameters()).load_state_dict(ref)

    resumed, resumed_losses = _train(tmp_path / "resumed", _offload("nvme", swap_dir), resume=str(checkpoint),
                                     callbacks=[StreamingCheckpointCallback()])
    assert_params_equal(resumed, full)
    assert all(resumed_losses[s] == losses[s] for s in range(SAVE_AT + 1, STEPS + 1))
    plain, _ = _train(tmp_path / "plain", _offload("nvme", swap_dir))  # the callback changes nothing else
    assert_params_equal(plain, full)


@pytest.mark.slow
def test_a_moved_or_copied_checkpoint_resumes_bit_identically(tmp_path):
    """optimizer.pt names its swapio-optim/ by absolute path. A checkpoint directory moved elsewhere was a
    FileNotFoundError on resume, and a copy put back at the old path (another machine, a restored backup) a
    ValueError ("rewritten since"). SwapioTrainer now looks in the checkpoint it resumes first, and a copy of the
    same save is recognised by its content; a directory rewritten by another run is still refused."""
    from swapio.integrations.transformers import StreamingCheckpointCallback, SwapioTrainer
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    full, losses = _train(tmp_path / "full", _offload("nvme", swap_dir), callbacks=[StreamingCheckpointCallback()])
    moved = tmp_path / "elsewhere"
    os.rename(tmp_path / "full", moved)
    checkpoint = moved / f"checkpoint-{SAVE_AT}"
    with pytest.raises(FileNotFoundError, match="resume with SwapioTrainer"):  # plain Trainer cannot know where
        _train(tmp_path / "plain", _offload("nvme", swap_dir), resume=str(checkpoint),
               callbacks=[StreamingCheckpointCallback()])
    resumed, resumed_losses = _train(tmp_path / "resumed", _offload("nvme", swap_dir), resume=str(checkpoint),
                                     callbacks=[StreamingCheckpointCallback()], trainer_cls=SwapioTrainer)
    assert_params_equal(resumed, full)
    assert all(resumed_losses[s] == losses[s] for s in range(SAVE_AT + 1, STEPS + 1))

    shutil.copytree(moved, tmp_path / "full")  # a copy at the recorded path: other files, the same content
    again, again_losses = _train(tmp_path / "again", _offload("nvme", swap_dir),
                                 resume=str(tmp_path / "full" / f"checkpoint-{SAVE_AT}"),
                                 callbacks=[StreamingCheckpointCallback()])
    assert_params_equal(again, full)
    assert all(again_losses[s] == losses[s] for s in range(SAVE_AT + 1, STEPS + 1))


class _CreatesOffloadAdamW(Trainer):
    """A Trainer subclass that builds its own optimizer, the third way Trainer can be given one."""

    swap_dir = None

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = _offload("nvme", self.swap_dir)(self.model.parameters())
        return self.optimizer


def _train_given(how, out_dir, swap_dir, resume=None):
    """Trains with the optimizer handed to Trainer `how`: "optimizers" (an instance), "optimizer_cls_and_kwargs"
    (Trainer builds it in train(), after on_init_end) or "create_optimizer" (a subclass builds it, also late),
    always with StreamingCheckpointCallback. Returns (params, per-step losses, the optimizer)."""
    from swapio.integrations.transformers import StreamingCheckpointCallback
    model = tiny_gpt2()
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    kwargs = dict(model=model, args=args, train_dataset=TokenData(), callbacks=[StreamingCheckpointCallback()])
    io = {"swap_dir": swap_dir, "buffer_bytes": 3 << 16, "buffer_count": 3}
    trainer_cls = Trainer
    if how == "optimizers":
        opt = so.OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload="nvme", **io)
        kwargs["optimizers"] = (opt, get_linear_schedule_with_warmup(opt, num_warmup_steps=2,
                                                                     num_training_steps=STEPS))
    elif how == "optimizer_cls_and_kwargs":
        kwargs["optimizer_cls_and_kwargs"] = (so.OffloadAdamW, dict(lr=1e-2, offload="nvme", **io))
    else:
        trainer_cls = type("Subclass", (_CreatesOffloadAdamW,), {"swap_dir": swap_dir})
    trainer = trainer_cls(**kwargs)
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, so.OffloadAdamW)
    opt.close()
    return params_of(model), losses


@pytest.mark.slow
@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs", "create_optimizer"])
def test_streaming_callback_resumes_whichever_way_trainer_got_the_optimizer(how, tmp_path):
    # The callback used to patch load_state_dict only onto an optimizer that existed at on_init_end, so resuming
    # with an optimizer Trainer builds itself raised "different number of parameter groups" on the reference.
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    full, losses = _train_given(how, tmp_path / "full", swap_dir)
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    assert "swapio_checkpoint" in torch.load(checkpoint / "optimizer.pt", weights_only=True)
    resumed, resumed_losses = _train_given(how, tmp_path / "resumed", swap_dir, resume=str(checkpoint))
    assert_params_equal(resumed, full)
    for step in range(SAVE_AT + 1, STEPS + 1):  # steps 1..SAVE_AT come from the checkpoint's log history
        assert resumed_losses[step] == losses[step], step
    assert os.listdir(swap_dir) == []
