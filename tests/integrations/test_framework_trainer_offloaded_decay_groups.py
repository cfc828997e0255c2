"""SwapioTrainer clipping an offloaded model whose optimizer Trainer built with its weight-decay groups (decay,
then no-decay: another order than model.parameters()): the logged grad_norm and the weights equal the resident
run's bits, because opt.clip_grad_norm_ sums the per-tensor norms in the order torch's clip_grad_norm_ does."""
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import disk_offload  # noqa: E402
from helpers.frameworks import TokenData, tiny_gpt2  # noqa: E402
from helpers.offload import one_thread  # noqa: E402

STEPS = 6


def _train(tmp_path, offload):
    from swapio.integrations.transformers import SwapioTrainer
    model = tiny_gpt2()
    if offload:
        model = disk_offload(model, os.path.join(tmp_path, "od"), buffer_bytes=64 << 10)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2,
                             max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to="none",
                             use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = SwapioTrainer(model=model, args=args, train_dataset=TokenData(n=36),
                            optimizer_cls_and_kwargs=(so.OffloadAdamW, {}))
    with one_thread():
        trainer.train()
    opt = trainer.optimizer.optimizer
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # Trainer's two groups
    weights = {n: opt.param_value(p).clone() for n, p in model.named_parameters()}
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    opt.close()
    return weights, norms


@pytest.mark.slow
def test_trainer_decay_groups_clip_the_offloaded_model_as_the_resident_one(tmp_path):
    """The grad_norm logged at steps 3 and 6 differed from the resident run's in the last bit, and so did the
    weights: the norms were summed in param-group order."""
    ref_weights, ref_norms = _train(tmp_path / "resident", offload=False)
    weights, norms = _train(tmp_path / "offloaded", offload=True)
    assert norms == ref_norms
    for name, value in ref_weights.items():
        assert torch.equal(weights[name], value), name


def _grads_summed(tmp_path):
    """An offloaded tiny GPT-2 after one backward, its optimizer's groups in another order than its parameters."""
    model = disk_offload(tiny_gpt2(), tmp_path / "od")
    params = list(model.parameters())
    opt = so.OffloadAdamW([{"params": params[1::2]}, {"params": params[0::2], "weight_decay": 0.0}])
    batch = TokenData(n=4)[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    return model, opt


def test_clip_grad_norm_parameters_gives_torchs_order(tmp_path):
    model, opt = _grads_summed(tmp_path)
    ref = tiny_gpt2()
    batch = TokenData(n=4)[0]
    ref(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    got = opt.clip_grad_norm_(1e-3, parameters=model.parameters())
    assert torch.equal(got, want)
    opt.close()


def test_clip_grad_norm_parameters_leaving_out_an_offloaded_sum_is_refused(tmp_path):
    model, opt = _grads_summed(tmp_path)
    with pytest.raises(ValueError, match="leaves out 1 offloaded weight"):
        opt.clip_grad_norm_(1.0, parameters=list(model.parameters())[1:])
    opt.close()
