"""Optimizer offload with the Hugging Face Trainer: OffloadAdamW keeps the optimizer state on disk (nvme mode),
and StreamingCheckpointCallback checkpoints it with opt.save() instead of torch.save(state_dict()).

A tiny GPT-2 (random weights, no download) trains for 6 steps with a checkpoint at step 3, then a second run
resumes from that checkpoint; its final weights equal the first run's bit for bit.

    python examples/optimizer_offload_trainer.py [--dir DIR]   # DIR: output and swap files (default: temporary)

Prints the losses and "ok"; a mismatch raises.
"""
import argparse
import os
import tempfile

import torch
import transformers
from transformers import Trainer, TrainingArguments

import swapio
from swapio.integrations.transformers import StreamingCheckpointCallback


class RandomTokens(torch.utils.data.Dataset):
    """32 fixed random sequences of 16 tokens, for causal language modelling."""

    def __init__(self):
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out_dir, swap_dir, resume=None):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out_dir, max_steps=6, save_steps=3, per_device_train_batch_size=4,
                             logging_steps=1, report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
                             disable_tqdm=True)
    # Trainer builds the optimizer itself from optimizer_cls_and_kwargs (optimizers=(opt, sched) works too)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(),
                      optimizer_cls_and_kwargs=(swapio.optim.OffloadAdamW,
                                                {"lr": 1e-3, "offload": "nvme", "swap_dir": swap_dir}),
                      callbacks=[StreamingCheckpointCallback()])
    trainer.train(resume_from_checkpoint=resume)
    getattr(trainer.optimizer, "optimizer", trainer.optimizer).close()  # (accelerate wraps it) removes its swap file
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, losses


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory for the runs and the swap files (default: a temporary directory)")
    args = p.parse_args()
    transformers.logging.set_verbosity_error()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)  # a new directory is made, as swapio's swap_dir is
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        full, losses = train(f"{tmp}/full", tmp)
        print("losses:", " ".join(f"{x:.4f}" for x in losses))
        resumed, _ = train(f"{tmp}/resumed", tmp, resume=f"{tmp}/full/checkpoint-3")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    print("resumed from checkpoint-3 (optimizer state streamed back from disk): final weights bit-identical")
    print("ok")


if __name__ == "__main__":
    main()
