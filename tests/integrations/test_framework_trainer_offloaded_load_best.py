"""SwapioTrainer with load_best_model_at_end=True: Trainer loads the best checkpoint with load_state_dict after the
whole run, which cannot change offloaded weights. For an offloaded model it is a ValueError when the Trainer is
built, before any training; peft adapters over an offloaded base (resident) load as for the resident peft model."""
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, disk_offload  # noqa: E402
from helpers.frameworks import TokenData, tiny_gpt2  # noqa: E402
from helpers.offload import one_thread  # noqa: E402


def _args(out_dir):
    # on these random tokens the eval loss rises as LoRA trains: the best checkpoint is an early one (asserted)
    return TrainingArguments(output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                             load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
                             logging_steps=1,
                             report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_load_best_model_at_end_of_an_offloaded_model_is_refused_before_training(tmp_path, offload):
    """It raised only when training ended, from load_state_dict (one line per offloaded weight)."""
    from swapio.integrations.transformers import SwapioTrainer
    model = disk_offload(tiny_gpt2(), tmp_path / "od") if offload == "disk" else cpu_offload(tiny_gpt2())
    opt = so.OffloadAdamW(model.parameters())
    with pytest.raises(ValueError, match="load_best_model_at_end=True is not supported for a model offloaded"):
        SwapioTrainer(model=model, args=_args(tmp_path / "out"), train_dataset=TokenData(),
                      eval_dataset=TokenData(n=8, seed=1), optimizers=(opt, None))
    assert not os.path.exists(tmp_path / "out" / "checkpoint-1")
    opt.close()


def _peft_run(tmp_path, offload):
    peft = pytest.importorskip("peft")
    from swapio.integrations.transformers import SwapioTrainer
    model = tiny_gpt2()
    if offload:
        model = disk_offload(model, tmp_path / "od")
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                       fan_in_fan_out=True, init_lora_weights="gaussian"))
    trainer = SwapioTrainer(model=model, args=_args(tmp_path / "out"), train_dataset=TokenData(),
                            eval_dataset=TokenData(n=8, seed=1),
                            optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-2, "foreach": False}))
    with one_thread():
        trainer.train()
    best = os.path.basename(trainer.state.best_model_checkpoint)
    return best, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_load_best_model_at_end_of_lora_over_an_offloaded_base_loads_the_best_adapters(tmp_path):
    want_best, want = _peft_run(tmp_path / "resident", offload=False)
    got_best, got = _peft_run(tmp_path / "offloaded", offload=True)
    assert got_best == want_best != "checkpoint-3"
    assert sorted(got) == sorted(want) and want
    for name, value in want.items():
        assert torch.equal(got[name], value), name
