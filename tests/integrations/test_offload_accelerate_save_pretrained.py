"""accelerate's way of saving a transformers model (its examples, run_clm_no_trainer):
`accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=accelerator.is_main_process,
save_function=accelerator.save)`. For a model offloaded by swapio and trained through accelerate, it writes what
the resident model trained the same way writes: transformers takes save_function (and does not use it for
safetensors files), so swapio's save_pretrained takes it too (a TypeError before). Another state_dict
(accelerator.get_state_dict(model), swapio's placeholders) stays a ValueError that says what to do instead."""
import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import swapio.optim as so  # noqa: E402
from helpers.frameworks import tiny_gpt2  # noqa: E402
from swapio.offload import disk_offload, remove_offload  # noqa: E402

IDS = torch.arange(32).view(2, 16) % 50


def _trained(offload_dir=None):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    if offload_dir:
        model = disk_offload(model, offload_dir=offload_dir)
    opt = so.OffloadAdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(2):
        accelerator.backward(model(input_ids=IDS, labels=IDS).loss)
        opt.step()
        opt.zero_grad()
    return accelerator, model, opt


def _logits(directory):
    with torch.no_grad():
        return transformers.GPT2LMHeadModel.from_pretrained(directory)(input_ids=IDS).logits


def test_save_pretrained_with_accelerators_save_function_writes_the_trained_weights(tmp_path):
    accelerator, model, opt = _trained()
    accelerator.unwrap_model(model).save_pretrained(tmp_path / "resident", is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)
    opt.optimizer.close()

    accelerator, model, opt = _trained(tmp_path / "od")
    accelerator.unwrap_model(model).save_pretrained(tmp_path / "offloaded",
                                                    is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)
    with pytest.raises(ValueError, match=r"save_pretrained\(state_dict=\)"):
        accelerator.unwrap_model(model).save_pretrained(tmp_path / "sd", save_function=accelerator.save,
                                                        state_dict=accelerator.get_state_dict(model))
    opt.optimizer.close()
    remove_offload(model)
    torch.testing.assert_close(_logits(tmp_path / "offloaded"), _logits(tmp_path / "resident"), rtol=0, atol=0)
