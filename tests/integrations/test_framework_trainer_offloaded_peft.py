"""SwapioTrainer fine-tuning peft LoRA adapters over an offloaded base (disk_offload, then get_peft_model):
checkpoints and trainer.save_model hold the adapters as Trainer writes them for the resident peft model, and
resume_from_checkpoint continues bit-identically."""
import os

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from swapio.offload import disk_offload  # noqa: E402
from helpers.frameworks import TokenData, tiny_gpt2  # noqa: E402
from helpers.offload import one_thread  # noqa: E402

STEPS, SAVE_AT = 4, 2
ADAPTER = "adapter_model.safetensors"


def _train(tmp_path, offload, resume=None):
    from swapio.integrations.transformers import SwapioTrainer
    model = tiny_gpt2()
    if offload:
        model = disk_offload(model, tmp_path / "od")
    torch.manual_seed(3)  # the adapters' initial values
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                       fan_in_fan_out=True, init_lora_weights="gaussian"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-2, max_grad_norm=0.5, save_strategy="steps", save_steps=SAVE_AT,
                             logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = SwapioTrainer(model=model, args=args, train_dataset=TokenData(),
                            optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-2, "foreach": False}))
    with one_thread():
        trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(tmp_path / "saved"))
    logs = {h["step"]: (h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h}
    return load_file(str(tmp_path / "saved" / ADAPTER)), logs


def _assert_tensors_equal(got, want):
    assert sorted(got) == sorted(want) and want
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_lora_over_an_offloaded_base_saves_and_resumes_as_the_resident_run(tmp_path):
    """Trainer's first checkpoint raised 'base_model.model.transformer.wte.weight is on the meta device and not
    offloaded by swapio': the offloaded model's checkpoint writer was given the PeftModel. Now Trainer saves
    (and resumes) the adapters its own way, as for the resident peft model."""
    want, want_logs = _train(tmp_path / "resident", offload=False)
    got, logs = _train(tmp_path / "offloaded", offload=True)
    assert logs == want_logs
    _assert_tensors_equal(got, want)
    checkpoint = tmp_path / "offloaded" / "out" / f"checkpoint-{SAVE_AT}"
    _assert_tensors_equal(load_file(str(checkpoint / ADAPTER)),
                          load_file(str(tmp_path / "resident" / "out" / f"checkpoint-{SAVE_AT}" / ADAPTER)))
    assert not os.path.exists(checkpoint / "model.safetensors.index.json")  # adapters only, as peft saves
    resumed, resumed_logs = _train(tmp_path / "resumed", offload=True, resume=str(checkpoint))
    _assert_tensors_equal(resumed, want)
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed_logs[step] == want_logs[step], step
