"""Hugging Face Trainer with SwapioCheckpointCallback and a plain torch AdamW: each checkpoint's optimizer state
is written by swapio.checkpoint (a safetensors file the safetensors library reads), optimizer.pt only refers to
it, and a run resumed from the checkpoint ends bit-identical to an uninterrupted one."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

import swapio  # noqa: E402
from helpers.frameworks import TokenData, assert_params_equal, params_of, tiny_gpt2  # noqa: E402
from swapio.integrations.transformers import OPTIMIZER_FILE, SwapioCheckpointCallback  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _train(out_dir, resume=None, trainer_builds_optimizer=False):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    given = {}
    if trainer_builds_optimizer:
        given = {"optimizer_cls_and_kwargs": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False})}
    else:
        given = {"optimizers": (opt, sched)}
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[SwapioCheckpointCallback()],
                      **given)
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return params_of(model), losses, trainer.optimizer


@pytest.mark.slow
def test_trainer_saves_the_optimizer_with_swapio_and_resumes_bit_identically(tmp_path):
    import safetensors.torch as st
    full, losses, opt = _train(tmp_path / "full")
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    ref = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert ref["swapio_checkpoint"] == str(checkpoint / OPTIMIZER_FILE) and ref["state"] == {}
    saved = swapio.checkpoint.load(checkpoint / OPTIMIZER_FILE)
    assert sorted(saved["state"]) == list(range(len(list(tiny_gpt2().parameters()))))
    flat = st.load_file(str(checkpoint / OPTIMIZER_FILE))
    assert torch.equal(flat["state.0.exp_avg"], saved["state"][0]["exp_avg"])
    assert saved["state"][0]["step"].item() == SAVE_AT
    with pytest.raises(ValueError):  # another optimizer refuses the reference instead of loading nothing
        torch.optim.SGD(tiny_gpt2().parameters(), lr=0.1).load_state_dict(ref)

    resumed, resumed_losses, _ = _train(tmp_path / "resumed", resume=str(checkpoint))
    assert_params_equal(resumed, full)
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed_losses[step] == losses[step], step


@pytest.mark.slow
def test_an_optimizer_trainer_builds_is_saved_by_trainer_with_a_warning_and_resumes(tmp_path):
    """Trainer builds the optimizer after the callbacks' last chance to patch it and loads optimizer.pt right
    after: a swapio reference there could not be resumed, so the callback leaves the save to Trainer and says so."""
    with pytest.warns(swapio.SwapioWarning, match="optimizers="):
        full, losses, _ = _train(tmp_path / "full", trainer_builds_optimizer=True)
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_AT}"
    assert not (checkpoint / OPTIMIZER_FILE).exists()
    assert "state" in torch.load(checkpoint / "optimizer.pt", weights_only=True)
    resumed, resumed_losses, _ = _train(tmp_path / "resumed", resume=str(checkpoint), trainer_builds_optimizer=True)
    assert_params_equal(resumed, full)
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed_losses[step] == losses[step], step
