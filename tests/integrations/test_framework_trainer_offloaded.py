"""Hugging Face Trainer fine-tuning a model offloaded by swapio.offload (disk_offload / cpu_offload) with
OffloadAdamW, through swapio.integrations.transformers.SwapioTrainer: the losses and weights equal the same Trainer
run on the resident model (clipping active, gradient accumulation), and a run resumed from a checkpoint (a fresh
model on meta, offloaded again to the same offload_dir) ends with the weights of an uninterrupted one."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainingArguments, get_linear_schedule_with_warmup  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, disk_offload  # noqa: E402
from helpers.frameworks import VOCAB, SEQ, TokenData, assert_params_equal  # noqa: E402
from helpers.offload import one_thread  # noqa: E402

STEPS, SAVE_AT, MAX_NORM = 6, 3, 0.5


def tiny_gpt2(tied):
    """framework_helpers' tiny GPT-2, with or without its lm_head tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
    return GPT2LMHeadModel(config)


def _weights(model, opt):
    """{name: current value} of every parameter: offloaded ones as their storage holds them."""
    return {n: opt.param_value(p).clone() for n, p in model.named_parameters()}


def _train(out_dir, offload=None, resume=None, meta=False, tied=False, accumulate=2, max_norm=MAX_NORM,
           in_backward=False):
    from swapio.integrations.transformers import SwapioTrainer
    if meta:
        with torch.device("meta"):
            model = tiny_gpt2(tied)
    else:
        model = tiny_gpt2(tied)
    if offload == "disk":
        model = disk_offload(model, os.path.join(out_dir, "..", "od"), buffer_bytes=64 << 10)
    elif offload == "cpu":
        model = cpu_offload(model)
    opt = so.OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, in_backward=in_backward)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    args = TrainingArguments(output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulate, max_grad_norm=max_norm, save_strategy="steps",
                             save_steps=SAVE_AT, logging_steps=1, report_to="none", use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = SwapioTrainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, sched))
    with one_thread():
        trainer.train(resume_from_checkpoint=resume)
    logs = {h["step"]: (h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h}
    weights = _weights(model, opt)
    opt.close()
    return weights, logs


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_offloaded_trainer_equals_resident_and_resumes(offload, tmp_path):
    ref, ref_logs = _train(tmp_path / "resident")
    assert any(norm > MAX_NORM for _, norm in ref_logs.values())  # clipping is active
    got, logs = _train(tmp_path / "offloaded", offload)
    assert logs == ref_logs  # losses and grad norms, exactly
    assert_params_equal(got, ref)
    checkpoint = tmp_path / "offloaded" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "model.safetensors.index.json").is_file()
    if offload != "disk":
        return
    # a fresh model on meta, offloaded to the same offload_dir (which holds the weights of step STEPS now)
    resumed, resumed_logs = _train(tmp_path / "resumed", "disk", resume=str(checkpoint), meta=True)
    assert_params_equal(resumed, ref)
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed_logs[step] == logs[step], step


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_tied_weights_with_accumulation_equal_the_resident_run(offload, tmp_path):
    # GPT-2's lm_head tied to wte: each backward sums the tie's two uses before adding to the sum, as autograd
    # does for .grad, so accumulation gives the resident run's bits (docs/offload.md once said the last bit differed)
    ref, ref_logs = _train(tmp_path / "resident", tied=True)
    got, logs = _train(tmp_path / "offloaded", offload, tied=True)
    assert logs == ref_logs
    assert_params_equal(got, ref)


def test_torch_optimizer_over_offloaded_weights_is_a_clear_error(tmp_path):
    from swapio.integrations.transformers import SwapioTrainer
    model = disk_offload(tiny_gpt2(False), tmp_path / "od")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    opt = torch.optim.AdamW(model.parameters())
    trainer = SwapioTrainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, None))
    with pytest.raises(ValueError, match="OffloadAdamW"):
        trainer.train()


@pytest.mark.slow
def test_in_backward_trains_like_the_resident_model(tmp_path):
    # max_grad_norm=0: in_backward steps each module during backward, so there is nothing left to clip
    ref, ref_logs = _train(tmp_path / "resident", accumulate=1, max_norm=0.0)
    got, logs = _train(tmp_path / "offloaded", "disk", accumulate=1, max_norm=0.0, in_backward=True)
    assert [loss for loss, _ in logs.values()] == [loss for loss, _ in ref_logs.values()]
    assert_params_equal(got, ref)


@pytest.mark.parametrize("max_norm,accumulate", [(1.0, 1), (0.0, 2)])
@pytest.mark.parametrize("given", [True, False])
def test_in_backward_with_clipping_or_accumulation_is_refused_before_any_weight_changes(tmp_path, max_norm,
                                                                                        accumulate, given):
    """in_backward=True with Trainer's default max_grad_norm=1.0 (or gradient accumulation) raised only after
    the first backward had updated the weights. Now a ValueError naming the setting when the Trainer is built
    (optimizer given) or before training starts (optimizer_cls_and_kwargs), the weights untouched."""
    from swapio.integrations.transformers import SwapioTrainer
    model = disk_offload(tiny_gpt2(False), tmp_path / "od")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, max_grad_norm=max_norm,
                             gradient_accumulation_steps=accumulate, report_to="none", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    what = "max_grad_norm" if max_norm else "gradient_accumulation_steps"
    want = dict(tiny_gpt2(False).named_parameters())
    if given:
        opt = so.OffloadAdamW(model.parameters(), lr=1e-2, in_backward=True)
        with pytest.raises(ValueError, match=f"(?s){what}.*in_backward=True"):
            SwapioTrainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, None))
    else:
        trainer = SwapioTrainer(model=model, args=args, train_dataset=TokenData(),
                                optimizer_cls_and_kwargs=(so.OffloadAdamW, {"lr": 1e-2, "in_backward": True}))
        with pytest.raises(ValueError, match=f"(?s){what}.*in_backward=True"):
            with one_thread():
                trainer.train()
        opt = trainer.optimizer
    assert isinstance(opt, so.OffloadAdamW) and not any(opt.state.values())  # no step was taken
    for n, v in _weights(model, opt).items():
        assert torch.equal(v, want[n].detach()), n
    opt.close()


@pytest.mark.parametrize("case", ["index-outside", "index-absolute", "shape", "dtype", "missing"])
def test_resume_reads_resident_tensors_checked_and_only_from_inside_the_checkpoint(tmp_path, case):
    """resume_from_checkpoint of an offloaded model copies the checkpoint's resident tensors into the model: the
    index's shard names were joined to the directory unchecked (a shard outside it was read), a tensor of another
    shape was broadcast into the model's and one of another dtype cast, and a missing one skipped, silently. Now
    each is a ValueError naming the file, before any tensor of the model changes."""
    from safetensors.torch import save_file
    from swapio.integrations.transformers import _load_resident
    model = torch.nn.Linear(4, 4)  # resident: every tensor of it is read from the checkpoint
    before = {k: v.clone() for k, v in model.state_dict().items()}
    directory = tmp_path / "checkpoint-3"
    directory.mkdir()
    good = {"weight": torch.full((4, 4), 7.0), "bias": torch.full((4,), 7.0)}
    save_file(good, str(directory / "model.safetensors"))
    _load_resident(model, str(directory))
    assert all(torch.equal(model.state_dict()[k], good[k]) for k in good)  # a valid checkpoint loads
    model.load_state_dict(before)
    tensors, match = dict(good), None
    if case.startswith("index"):
        save_file(good, str(tmp_path / "outside.safetensors"))
        shard = "../outside.safetensors" if case == "index-outside" else str(tmp_path / "outside.safetensors")
        os.remove(directory / "model.safetensors")
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"weight": shard, "bias": shard}}))
        match = "outside the checkpoint directory"
    elif case == "shape":
        tensors["weight"], match = torch.full((1, 4), 7.0), r"'weight' has shape \[1, 4\]"
    elif case == "dtype":
        tensors["weight"], match = torch.full((4, 4), 7.0, dtype=torch.float64), "'weight' is torch.float64"
    else:
        del tensors["bias"]
        match = "lacks tensor 'bias'"
    if not case.startswith("index"):
        save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        _load_resident(model, str(directory))
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # nothing copied
