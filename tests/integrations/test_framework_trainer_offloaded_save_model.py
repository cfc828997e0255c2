"""trainer.save_model (and so each checkpoint) of a model offloaded by swapio.offload, through SwapioTrainer: the
directory holds what Trainer writes for the resident model (weights that from_pretrained reads back equal, the
config, the training arguments, the tokenizer), whichever way Trainer was given the tokenizer."""
import os

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, TrainingArguments  # noqa: E402
from transformers.data.data_collator import default_data_collator  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import disk_offload  # noqa: E402
from helpers.frameworks import TokenData, tiny_gpt2  # noqa: E402
from helpers.offload import one_thread  # noqa: E402

WEIGHT_FILES = {"model.safetensors", "model.safetensors.index.json", "model-00001-of-00001.safetensors"}


def _tokenizer():
    from tokenizers import Tokenizer, models
    vocab = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="[UNK]", pad_token="[UNK]")


class _CollatorWithTokenizer:
    """A data collator that carries the tokenizer, as DataCollatorForLanguageModeling does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, features):
        return default_data_collator(features)


def _save_model(tmp_path, offload, given):
    from swapio.integrations.transformers import SwapioTrainer
    model = tiny_gpt2()
    if offload:
        model = disk_offload(model, tmp_path / "od")
    opt = so.OffloadAdamW(model.parameters(), lr=1e-2)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                             dataloader_num_workers=0)
    tokenizer = {"processing_class": _tokenizer()} if given == "processing_class" else \
        {"data_collator": _CollatorWithTokenizer(_tokenizer())}
    trainer = SwapioTrainer(model=model, args=args, train_dataset=TokenData(), optimizers=(opt, None), **tokenizer)
    with one_thread():
        trainer.train()
    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    opt.close()
    return saved


@pytest.mark.parametrize("given", ["processing_class", "data_collator"])
def test_save_model_of_an_offloaded_model_writes_what_the_resident_one_does(tmp_path, given):
    """The offloaded model's directory lacked training_args.bin, and the tokenizer when Trainer had it from the
    data collator (Trainer._save writes both)."""
    want = _save_model(tmp_path / "resident", False, given)
    got = _save_model(tmp_path / "offloaded", True, given)
    assert set(os.listdir(got)) - WEIGHT_FILES == set(os.listdir(want)) - WEIGHT_FILES
    args = torch.load(got / "training_args.bin", weights_only=False)
    assert args.max_steps == 2 and args.output_dir == str(tmp_path / "offloaded" / "out")
    assert PreTrainedTokenizerFast.from_pretrained(str(got)).get_vocab() == {"[UNK]": 0, "a": 1}
    want_sd = GPT2LMHeadModel.from_pretrained(str(want)).state_dict()
    got_sd = GPT2LMHeadModel.from_pretrained(str(got)).state_dict()
    assert sorted(got_sd) == sorted(want_sd)
    for name, value in want_sd.items():
        assert torch.equal(got_sd[name], value), name
