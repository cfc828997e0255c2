"""in_backward=True on offloaded weights, p.grad dropped or zeroed between backward and step() (`p.grad = None` to
freeze a layer for a step, as DINO's cancel_gradients_last_layer does; model.zero_grad(); p.grad.zero_()): torch's
step() skips such a weight (or steps it with zeros), but its update ran during backward, and step() went on
silently. Now step() refuses it before anything more changes (the resident weights included), naming
in_backward=False; zero_grad() goes on. What ran is the whole step backward handed over: the resident model
stepped with every gradient. A gradient hook that drops the gradient during backward still works (the update
honours it), and a backward that raised may still be dropped with model.zero_grad() (docs/offload.md)."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, assert_same_weights, batches, build_opt, loss_of, make_model, offload,
                                      one_thread, train, weights)

pytest.importorskip("safetensors")


def _drop(model, how):
    if how == "last_layer":
        for p in model.c.parameters():
            p.grad = None
    elif how == "model_zero_grad":
        model.zero_grad()
    else:
        model.c.bias.grad.zero_()


@pytest.mark.parametrize("how", ["last_layer", "model_zero_grad", "zero_"])
@pytest.mark.parametrize("storage, off", [("disk", "nvme"), ("cpu", "cpu")])
def test_a_gradient_dropped_after_an_in_backward_update_is_refused_at_step(tmp_path, storage, off, how):
    data = batches(MLP, 3)
    ref = make_model()
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref-swap", offload=off)
    model = offload(make_model(), storage, tmp_path, keep_resident=["norm"])
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off, in_backward=True)
    with one_thread():
        loss_of(model, data[0]).backward()
        _drop(model, how)
        resident = [p.detach().clone() for p in model.norm.parameters()]
        with pytest.raises(RuntimeError, match=r"(?s)p\.grad of '[abc]\.\w+'.*dropped or zeroed.*in_backward=False"):
            opt.step()
        assert all(torch.equal(p, r) for p, r in zip(model.norm.parameters(), resident))  # nothing more stepped
        opt.zero_grad()
        loss_of(ref, data[0]).backward()
        for p in ref.norm.parameters():
            p.grad = None  # the resident weights were not stepped: the reference leaves them too
        ref_opt.step()
        ref_opt.zero_grad()
        for m, o in ((ref, ref_opt), (model, opt)):
            train(m, o, data[1:])
    ref_opt.close()
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def test_a_hook_that_drops_a_gradient_during_backward_still_skips_the_weight(tmp_path):
    data = batches(MLP, 2)
    models = [make_model(), offload(make_model(), "cpu", tmp_path)]
    opts = [build_opt("AdamW", models[0].parameters(), tmp_path / "r", offload="cpu"),
            build_opt("AdamW", models[1].parameters(), tmp_path / "s", offload="cpu", in_backward=True)]
    for m in models:
        m.c.bias.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    with one_thread():
        for m, o in zip(models, opts):
            train(m, o, data)
    for o in opts:
        o.close()
    remove_offload(models[1])
    assert_same_weights(weights(models[1]), weights(models[0]))
