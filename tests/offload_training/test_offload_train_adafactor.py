"""OffloadAdafactor training weights offloaded by swapio.offload (disk_offload, a checkpoint, cpu_offload), with
summed micro-batches, in_backward and clip_grad_norm_: exactly the losses and weights of the same model trained
resident with the same optimizer (torch.equal); and a resident model trained against torch.optim.Adafactor."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt,
                                      clipped_norms,
                                      make_model, offload, resident_run, train, weights)

pytest.importorskip("safetensors")

CASES = [("disk", "accum1", "fp32", "nvme"), ("ckpt", "accum2", "bf16", "cpu"), ("cpu", "inback", "fp32", "cpu"),
         ("disk", "inback", "bf16", "nvme"), ("cpu", "accum2", "fp32", "nvme"), ("ckpt", "accum1", "fp32", "cpu")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("storage,mode,wdtype,off", CASES)
@pytest.mark.parametrize("cls", [MLP, Tied])
def test_offloaded_training_equals_resident(tmp_path, storage, mode, wdtype, off, cls):
    dtype, micro = DTYPES[wdtype], 2 if mode == "accum2" else 1
    data = batches(cls, 3 * micro)
    kw = dict(offload=off, in_backward=mode == "inback")
    want_losses, want = resident_run(cls, dtype, "Adafactor", data, tmp_path, micro, kw)
    model = offload(make_model(cls, dtype), storage, tmp_path, cls, dtype)
    opt = build_opt("Adafactor", model.parameters(), tmp_path, **kw)
    assert_same_losses(train(model, opt, data, micro), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), want)
    opt.close()


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
def test_clip_grad_norm_equals_torch_on_resident(tmp_path, storage, off):
    data = batches(MLP, 3)

    ref = make_model()
    with build_opt("Adafactor", ref.parameters(), tmp_path / "r", offload=off) as opt:
        want_norms = clipped_norms(ref, opt, data, lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    model = offload(make_model(), storage, tmp_path)
    with build_opt("Adafactor", model.parameters(), tmp_path, offload=off) as opt:
        got_norms = clipped_norms(model, opt, data, lambda m, o: o.clip_grad_norm_(0.05))
    assert all(torch.equal(g.reshape(()), w.reshape(())) for g, w in zip(got_norms, want_norms))
    assert all(w > 0.05 for w in want_norms)  # clipping did happen
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_resident_model_trains_like_torch_adafactor(tmp_path, off):
    data = batches(MLP, 10)
    ours, ref = make_model(), make_model()
    with build_opt("Adafactor", ours.parameters(), tmp_path, offload=off, weight_decay=0.0) as opt:
        got = train(ours, opt, data)
    want = train(ref, torch.optim.Adafactor(ref.parameters(), lr=1e-2), data)
    for g, w in zip(got, want):
        assert g.item() == pytest.approx(w.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_error_for_an_unowned_weight_names_offload_adafactor_too(tmp_path):
    """A gradient reaching an offloaded weight no swapio optimizer owns is a ValueError that lists the optimizers
    that can own it: every one of swapio.optim's, OffloadAdafactor included (it trains them, above; the message
    named only the Adam and Lion ones)."""
    import swapio.optim
    from swapio.offload import disk_offload
    model = disk_offload(torch.nn.Sequential(torch.nn.Linear(4, 4)), offload_dir=str(tmp_path / "od"))
    with pytest.raises(ValueError, match="no swapio optimizer owns it") as err:
        model(torch.randn(2, 4)).sum().backward()
    for name in swapio.optim.__all__:
        if name != "OffloadOptimizer":
            assert name in str(err.value), name
    remove_offload(model)
