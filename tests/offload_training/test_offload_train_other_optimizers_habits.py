"""Lion, Adafactor and low-precision optimizer state training offloaded weights together with the habits a torch
loop brings: gradient hooks on the parameters (one scaling a weight's gradient, a clamp on each in place of
clip_grad_value_, post-accumulate hooks), clip_grad_norm_ and micro-batches summed before each step. torch.equal
against the same loop on the resident model with the same optimizer (torch's clip_grad_norm_ there)."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, assert_same_losses, assert_same_weights, batches, build_opt, loss_of,
                                      make_model, offload, one_thread, weights)

pytest.importorskip("safetensors")


def add_hooks(model, log):
    model.b.weight.register_hook(lambda g: g * 0.5)
    for n, p in model.named_parameters():
        p.register_hook(lambda g: g.clamp(-0.02, 0.02))
        p.register_post_accumulate_grad_hook(lambda p, n=n: log.append(n))


def run(model, opt, data, micro, clip):
    losses, norms, log = [], [], []
    add_hooks(model, log)
    with one_thread():
        for k in range(0, len(data), micro):
            for b in data[k:k + micro]:
                loss = loss_of(model, b)
                loss.backward()
                losses.append(loss.detach().clone())
            if clip is not None:
                norms.append(clip(model, opt).reshape(()))
            opt.step()
            opt.zero_grad()
    return losses, norms, sorted(log)


@pytest.mark.parametrize("name,state_dtype,storage,off,micro,in_backward", [
    ("Lion", "int8", "disk", "nvme", 2, False), ("Lion", "bf16", "cpu", "cpu", 1, True),
    ("Adafactor", "fp32", "ckpt", "cpu", 2, False), ("Adafactor", "fp32", "disk", "nvme", 1, True),
    ("AdamW", "int8", "cpu", "nvme", 2, False), ("AdamW", "bf16", "disk", "cpu", 1, True)])
def test_hooks_clipping_and_accumulation_equal_resident(tmp_path, name, state_dtype, storage, off, micro,
                                                        in_backward):
    data = batches(MLP, 3 * micro)
    kw = dict(offload=off, state_dtype=state_dtype)
    ref = make_model()
    with build_opt(name, ref.parameters(), tmp_path / "r", **kw) as opt:
        clip = None if in_backward else (lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01))
        want = run(ref, opt, data, micro, clip)
    model = offload(make_model(), storage, tmp_path)
    with build_opt(name, model.parameters(), tmp_path / "s", in_backward=in_backward, **kw) as opt:
        got = run(model, opt, data, micro, None if in_backward else (lambda m, o: o.clip_grad_norm_(0.01)))
    assert_same_losses(got[0], want[0])
    assert_same_losses(got[1], want[1])
    assert in_backward or all(n > 0.01 for n in want[1])  # clipping did happen
    assert got[2] == want[2] and len(want[2]) == 8 * len(data)
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))
