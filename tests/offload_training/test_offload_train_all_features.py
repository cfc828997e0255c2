"""Every training feature at once on a tiny Llama: weights offloaded to disk, optimizer state and activations on
nvme, non-reentrant gradient checkpointing, a warmup scheduler, a sequence length that changes each step, and a
KeyboardInterrupt raised from a forward hook partway (caught, the loop goes on). Accumulating mode adds 2
micro-batches and clipping; in_backward=True is compared with torch's optimizer-in-backward hooks. Losses and
final weights equal the resident model's trained by torch.optim.AdamW(fused=True) bit for bit, and a run saved
halfway and rebuilt from scratch (the model on meta, offloaded from save_checkpoint's export into a new
offload_dir) ends where the uninterrupted one ends."""
import os

import pytest
import torch

import swapio
from swapio.offload import disable_activation_offload, disk_offload, enable_activation_offload, remove_offload
from swapio.optim import OffloadAdamW
from helpers.offload import one_thread

transformers = pytest.importorskip("transformers")

STEPS, HALF, LR = 4, 2, 1e-2
INTERRUPTED = 3  # the forward of layer 1 that raises KeyboardInterrupt (counted over the whole run)


def llama():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def data(micro):
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, 64, (2, 6 + 3 * (s % 3)), generator=g) for _ in range(micro)] for s in range(STEPS)]


def sched_of(opt):
    return transformers.get_linear_schedule_with_warmup(opt, 2, 10)


def train(model, opt, sched, batches, first, clip, calls):
    """Steps first.. over batches; `clip(model)` returns the norm (None: no clipping). Returns losses and norms."""
    out = []

    def interrupt(module, args):
        calls[0] += 1
        if calls[0] == INTERRUPTED:
            raise KeyboardInterrupt

    hook = model.model.layers[1].register_forward_pre_hook(interrupt)
    try:
        for mbs in batches[first:]:
            for ids in mbs:
                try:
                    loss = model(input_ids=ids, labels=ids).loss / len(mbs)
                except KeyboardInterrupt:
                    out.append("interrupted")
                    continue
                loss.backward()
                out.append(loss.item())
            norm = clip(model)
            if norm is not None:
                out.append(norm.item())
            if opt is not None:
                opt.step()
                opt.zero_grad()
            sched.step()
    finally:
        hook.remove()
    return out


def resident(in_backward, batches):
    model = llama()
    if in_backward:  # torch's optimizer-in-backward: one AdamW per parameter, stepped by its gradient hook
        per = {p: torch.optim.AdamW([p], lr=LR, weight_decay=0.01, fused=True) for p in model.parameters()}
        scheds = [sched_of(o) for o in per.values()]

        def step(p):
            per[p].step()
            per[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)

        class Scheds:
            def step(self):
                for s in scheds:
                    s.step()

        losses = train(model, None, Scheds(), batches, 0, lambda m: None, [0])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
        losses = train(model, opt, sched_of(opt), batches, 0,
                       lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0), [0])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def offloaded(tmp, name, in_backward, checkpoint=None):
    if checkpoint is None:
        model = llama()
    else:
        with torch.device("meta"):
            model = llama()
    model = disk_offload(model, offload_dir=str(tmp / name), checkpoint=checkpoint, buffer_bytes=64 << 10)
    enable_activation_offload(model, to="nvme", swap_dir=str(tmp), min_bytes=0, staging_bytes=4096, prefetch=1)
    opt = OffloadAdamW(model.parameters(), lr=LR, weight_decay=0.01, offload="nvme", swap_dir=str(tmp),
                       in_backward=in_backward)
    return model, opt, sched_of(opt)


def clip_of(opt, in_backward):
    return (lambda m: None) if in_backward else (lambda m: opt.clip_grad_norm_(1.0, parameters=m.parameters()))


def finish(model, opt):
    weights = {n: opt.param_value(p).clone() for n, p in model.named_parameters()}
    disable_activation_offload(model)
    opt.close()
    remove_offload(model)
    return weights


def assert_same_weights(got, want):
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("in_backward", [False, True])
def test_all_features_train_and_resume_as_resident(tmp_path, in_backward):
    with one_thread():
        run(tmp_path, in_backward)


def run(tmp_path, in_backward):
    batches = data(1 if in_backward else 2)
    want_losses, want = resident(in_backward, batches)

    model, opt, sched = offloaded(tmp_path, "od", in_backward)
    calls = [0]
    losses = train(model, opt, sched, batches[:HALF], 0, clip_of(opt, in_backward), calls)
    opt.save(str(tmp_path / "ckpt-optim"))
    swapio.offload.save_checkpoint(model, str(tmp_path / "ckpt-model"))
    saved = {"sched": sched.state_dict(), "rng": torch.get_rng_state(), "calls": calls[0]}
    losses += train(model, opt, sched, batches, HALF, clip_of(opt, in_backward), calls)
    assert "interrupted" in losses
    assert calls[0] > INTERRUPTED
    assert losses == want_losses
    assert_same_weights(finish(model, opt), want)

    # rebuilt from scratch, as a new process would: on meta, from the exported weights, into a new offload_dir
    model, opt, sched = offloaded(tmp_path, "od-resumed", in_backward, checkpoint=str(tmp_path / "ckpt-model"))
    opt.load(str(tmp_path / "ckpt-optim"))
    sched.load_state_dict(saved["sched"])
    torch.set_rng_state(saved["rng"])
    calls = [saved["calls"]]  # the hook's count goes on where it was
    resumed = train(model, opt, sched, batches, HALF, clip_of(opt, in_backward), calls)
    assert resumed == want_losses[len(want_losses) - len(resumed):]
    assert_same_weights(finish(model, opt), want)
