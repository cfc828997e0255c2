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


class WithNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.a(x))


def saved(obj, tmp_path):
    torch.save(obj, tmp_path / "saved.pt")
    return torch.load(tmp_path / "saved.pt", weights_only=False)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_torch_save_of_offloaded_parameters_and_buffers_is_refused(tmp_path, storage):
    """torch.save({n: p for n, p in model.named_parameters()}) (saving the trained weights by hand) wrote meta
    tensors without a word, as did torch.save of an offloaded buffer (offload_buffers=True); a RuntimeError naming
    the weight and save_checkpoint now, as torch.save(model.state_dict()) already was."""
    torch.manual_seed(0)
    ref = WithNorm().eval()
    torch.manual_seed(0)
    model = offload(WithNorm().eval(), storage, tmp_path, cls=WithNorm, offload_buffers=True)
    want = saved({n: p for n, p in ref.named_parameters()}, tmp_path)
    assert torch.equal(want["a.weight"], ref.a.weight)
    with pytest.raises(RuntimeError, match=r"a\.weight is offloaded by swapio.*save_checkpoint"):
        saved({n: p for n, p in model.named_parameters()}, tmp_path)
    with pytest.raises(RuntimeError, match=r"a\.bias is offloaded by swapio.*save_checkpoint"):
        saved(model.a.bias, tmp_path)
    with pytest.raises(RuntimeError, match=r"bn\.running_mean is offloaded by swapio.*save_checkpoint"):
        saved(dict(model.named_buffers()), tmp_path)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_values_from_an_offloaded_buffer_are_refused(tmp_path, storage):
    torch.manual_seed(0)
    ref = WithNorm().eval()
    torch.manual_seed(0)
    model = offload(WithNorm().eval(), storage, tmp_path, cls=WithNorm, offload_buffers=True)
    total = torch.zeros(6)
    total += ref.bn.running_var
    assert total.sum() == 6  # BatchNorm starts with unit variances
    with pytest.raises(RuntimeError, match=r"add_\(\) used bn\.running_var, which is offloaded by swapio"):
        torch.zeros(6).add_(model.bn.running_var)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_values_through_data_of_an_offloaded_buffer_are_refused(tmp_path, storage):
    """`.data` of an offloaded buffer (what an EMA of the buffers reads: `e.mul_(d).add_(b.data, alpha=1 - d)`)
    was a plain meta tensor, so the add did nothing without a word."""
    torch.manual_seed(0)
    ref = WithNorm().eval()
    torch.manual_seed(0)
    model = offload(WithNorm().eval(), storage, tmp_path, cls=WithNorm, offload_buffers=True)
    assert torch.zeros(6).add_(ref.bn.running_var.data).sum() == 6  # BatchNorm starts with unit variances
    with pytest.raises(RuntimeError, match=r"add_\(\) used bn\.running_var, which is offloaded by swapio"):
        torch.zeros(6).add_(model.bn.running_var.data)
    with pytest.raises(RuntimeError, match=r"add_\(\) used a\.weight, which is offloaded by swapio"):
        torch.zeros(6, 8).add_(model.a.weight.data.data)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
