"""Each backward gives an offloaded weight one gradient, as torch's .grad gets one per backward: gradient hooks
(p.register_hook, the documented stand-in for clip_grad_value_) run once per backward on that backward's whole
gradient. Two bugs counted uses by the leaves forwards made instead: two forwards then two backwards merged the
two backwards' gradients (hooks ran once, on their sum), and a second backward of one graph (retain_graph=True)
split a tied weight's gradient (hooks ran on each use's part, and the sum was added in another order), as did
opt.zero_grad() between a forward and its backward (it forgot the leaves that forward made)."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt,
                                      loss_of, make_model, offload, one_thread, weights)

pytest.importorskip("safetensors")


def run(model, opt, pattern, cls):
    """Two steps of `pattern`, with a clamping hook on every parameter; returns the hook calls and the losses."""
    calls, losses = [], []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: calls.append(name) or g.clamp(-0.01, 0.01))
    data = batches(cls, 4)
    with one_thread():
        for k in (0, 2):
            if pattern == "forward, forward, backward, backward":
                first, second = loss_of(model, data[k]), loss_of(model, data[k + 1])
                first.backward()
                second.backward()
            elif pattern == "forward, zero_grad, backward":  # opt.zero_grad() between a forward and its backward
                first = loss_of(model, data[k])
                opt.zero_grad()
                first.backward()
                opt.step()
                second = loss_of(model, data[k + 1])
                opt.zero_grad()
                second.backward()
            else:  # a second backward of one graph
                first = second = loss_of(model, data[k])
                first.backward(retain_graph=True)
                (3 * first).backward()
            opt.step()
            opt.zero_grad()
            losses += [first.detach(), second.detach()]
    return calls, losses


@pytest.mark.parametrize("pattern", ["forward, forward, backward, backward", "retain_graph",
                                     "forward, zero_grad, backward"])
@pytest.mark.parametrize("cls", [MLP, Tied])
@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
def test_hooks_and_sums_are_per_backward_as_on_resident(tmp_path, pattern, cls, storage, off):
    ref = make_model(cls)
    with build_opt("AdamW", ref.parameters(), tmp_path / "ref") as opt:
        want_calls, want_losses = run(ref, opt, pattern, cls)
    model = offload(make_model(cls), storage, tmp_path, cls)
    with build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off) as opt:
        calls, losses = run(model, opt, pattern, cls)
    assert sorted(calls) == sorted(want_calls)
    assert_same_losses(losses, want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def test_retain_graph_on_tied_gpt2_sums_as_torch(tmp_path):
    """Without hooks: the second backward's tied gradient (wte's and lm_head's uses) is summed before it is added,
    as autograd sums a leaf's inputs; it used to be added use by use (the last bit differed)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)

    def train(model, opt):
        g = torch.Generator().manual_seed(3)
        with one_thread():
            for _ in range(3):
                ids = torch.randint(0, 64, (2, 10), generator=g)
                loss = model(ids, labels=ids).loss
                loss.backward(retain_graph=True)
                (2 * loss).backward()
                opt.step()
                opt.zero_grad()

    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    model = offload(transformers.GPT2LMHeadModel(cfg), "disk", tmp_path)
    with build_opt("AdamW", ref.parameters(), tmp_path / "ref") as opt:
        train(ref, opt)
    with build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="nvme") as opt:
        train(model, opt)
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))
