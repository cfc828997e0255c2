"""transformers' gradient checkpointing (model.gradient_checkpointing_enable(), reentrant or not) on an offloaded
GPT-2 trained by a swapio optimizer, with dropout on: checkpoint's recomputation fetches the weights again and
replays the same dropout masks, so losses and final weights equal the resident model's exactly."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (assert_same_losses, assert_same_weights, build_opt, offload, one_thread, train,
                                     weights)

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def gpt2():
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def train_steps(model, opt):
    """3 steps in train mode on the same batches and dropout masks each time; their losses."""
    model.train()
    g = torch.Generator().manual_seed(3)
    losses = []
    torch.manual_seed(11)  # the dropout masks
    with one_thread():
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 10), generator=g)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return losses


def run(model, opt, reentrant):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return train_steps(model, opt)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("storage,off,in_backward", [("disk", "nvme", False), ("cpu", "cpu", False),
                                                     ("disk", "cpu", True)])
def test_gradient_checkpointing_trains_like_resident(tmp_path, reentrant, storage, off, in_backward):
    ref = gpt2()
    with build_opt("AdamW", ref.parameters(), tmp_path / "ref") as opt:
        want = run(ref, opt, reentrant)
    model = offload(gpt2(), storage, tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off, in_backward=in_backward) as opt:
        got = run(model, opt, reentrant)
    assert_same_losses(got, want)
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_lora_with_gradient_checkpointing_and_input_require_grads_trains_like_resident(tmp_path, reentrant, storage):
    """The usual peft recipe on a frozen offloaded base: gradient checkpointing, enable_input_require_grads() (so
    reentrant checkpoints see an input that requires grad), LoRA added after offloading, torch's AdamW."""
    peft = pytest.importorskip("peft")

    def build():
        model = gpt2()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        return model

    def lora(base):
        torch.manual_seed(5)  # the adapters' initial values
        config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                                 init_lora_weights=False)
        return peft.get_peft_model(base, config)

    def train_lora(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = train_steps(model, opt)
        return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    want_losses, want = train_lora(lora(build()))
    got_losses, got = train_lora(lora(offload(build(), storage, tmp_path)))
    assert_same_losses(got_losses, want_losses)
    assert sorted(got) == sorted(want) and want
    assert_same_weights(got, want)


class SharedLayer(torch.nn.Module):
    """One layer used twice in a forward (ALBERT-style), checkpointed in both uses or in one of them only."""

    def __init__(self, reentrant, both):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.shared, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.reentrant, self.both = reentrant, both

    def segment(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.segment, self.emb(x), use_reentrant=self.reentrant)
        h = torch.utils.checkpoint.checkpoint(self.segment, h, use_reentrant=self.reentrant) if self.both \
            else self.segment(h)
        return self.head(h)


def shared_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(3)]


@pytest.mark.parametrize("both", [True, False], ids=["two-segments", "inside-and-outside"])
@pytest.mark.parametrize("reentrant,in_backward", [(False, True), (False, False), (True, False)])
def test_weight_used_in_and_out_of_checkpoints_trains_like_resident(tmp_path, reentrant, in_backward, both):
    ref = SharedLayer(reentrant, both)
    with build_opt("AdamW", ref.parameters(), tmp_path / "ref") as opt:
        want = train(ref, opt, shared_batches())
    model = offload(SharedLayer(reentrant, both), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="cpu", in_backward=in_backward) as opt:
        got = train(model, opt, shared_batches())
    assert_same_losses(got, want)
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("both", [True, False], ids=["two-segments", "inside-and-outside"])
def test_in_backward_with_a_reentrant_checkpoint_of_a_shared_weight_says_what_to_do(tmp_path, both):
    """The reentrant checkpoint's own backward sees its segment only: the weight looks complete there and is updated;
    its other use then needs it again. Loud, and the message names the way out."""
    model = offload(SharedLayer(True, both), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="cpu", in_backward=True) as opt:
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            train(model, opt, shared_batches())
