"""Habits that compute from model.parameters() between forwards: an L2 penalty summed into a tensor, an EMA of the
weights, a weight norm logged. Offloaded, each parameter is a meta placeholder, and torch's in-place ops on a real
tensor given a meta operand do nothing: the penalty, the average and the norm silently stayed as they were
(the loss and the trained weights differed from the resident model's without a word). Now a RuntimeError naming
the weight; metadata (numel, shape, zeros_like on a device) still works, and training goes on as on the resident
model."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, assert_same_weights, batches, build_opt, loss_of, make_model, offload,
                                      one_thread, weights)

pytest.importorskip("safetensors")

STORAGES = ["disk", "cpu", "ckpt"]


def l2_penalty(model):
    total = torch.zeros(())
    for p in model.parameters():
        total += p.pow(2).sum()
    return total


def ema_update(ema, model, use):
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(use(p), alpha=0.1)


def logged_norm(model):
    total = torch.zeros(())
    with torch.no_grad():
        for p in model.parameters():
            total += p.norm() ** 2
    return total


@pytest.mark.parametrize("storage", STORAGES)
def test_l2_penalty_from_parameters_is_refused_and_training_goes_on(tmp_path, storage):
    data = batches(MLP, 2)
    ref = make_model()
    model = offload(make_model(), storage, tmp_path)
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref-swap", offload="cpu")
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="cpu")
    with one_thread():
        assert l2_penalty(ref) > 0  # the habit matters on the resident model
        with pytest.raises(RuntimeError, match=r"a\.weight, which is offloaded by swapio.*holding no values"):
            l2_penalty(model)
        with pytest.raises(RuntimeError, match=r"a\.weight, which is offloaded by swapio"):
            logged_norm(model)
        with pytest.raises(RuntimeError, match=r"a\.weight, which is offloaded by swapio"):  # a meta loss
            (loss_of(model, data[0]) + sum(p.pow(2).sum() for p in model.parameters())).backward()
        opt.zero_grad()
        for b in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                loss_of(m, b).backward()
                o.step()
                o.zero_grad()
    ref_opt.close()
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("use", [lambda p: p, lambda p: p.data, lambda p: p.detach()], ids=["p", "data", "detach"])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_ema_of_offloaded_weights_is_refused(tmp_path, storage, use):
    ref, ema_ref, ema = make_model(), make_model(seed=5), make_model(seed=5)
    model = offload(make_model(), storage, tmp_path)
    ema_update(ema_ref, ref, use)
    assert not torch.equal(ema_ref.a.weight, ema.a.weight * 0.9)  # the resident EMA took the weights in
    with pytest.raises(RuntimeError, match=r"add_\(\) used a\.weight, which is offloaded by swapio"):
        ema_update(ema, model, use)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_metadata_of_placeholders_still_answers(tmp_path, storage):
    ref = make_model()
    model = offload(make_model(), storage, tmp_path)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    for p, r in zip(model.parameters(), ref.parameters()):
        if p.dim() < 2:
            continue
        assert p.shape == r.shape and p.mT.shape == r.mT.shape and p.dtype == r.dtype
        zeros = torch.zeros_like(p, device="cpu")
        assert zeros.device.type == "cpu" and torch.equal(zeros, torch.zeros_like(r))
        assert p.new_zeros(2, device="cpu").sum() == 0
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
