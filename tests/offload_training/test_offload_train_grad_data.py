"""p.grad.data of an offloaded weight. torch's .data of the gradient marker was a plain meta tensor with a version
counter of its own, so the older habits through it changed nothing, without a word: `p.grad.data.zero_()` (how
zero_grad was long written) left the gradient to be summed into the next step's, and `p.grad.data.div_(n)`
(scaling for accumulation, averaging, clipping by hand) left it unscaled; either step then differed from the
resident model's. Now zeroing through .data trains exactly as the resident model does, and scaling raises a
RuntimeError naming the weight and the ways that work (scale the loss, or a gradient hook)."""
import os

import pytest
import torch

from helpers.offload_training import MLP, batches, build_opt, loss_of, make_model, offload, one_thread, weights
from swapio.offload import remove_offload

pytest.importorskip("safetensors")


def train(model, opt, data, clear):
    with one_thread():
        for b in data:
            loss_of(model, b).backward()
            opt.step()
            clear(model, opt)


def zero_through_data(model, opt):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()


@pytest.mark.parametrize("storage,off,in_backward", [("disk", "nvme", False), ("cpu", "cpu", False),
                                                     ("ckpt", "cpu", True)])
def test_grad_data_zero_trains_as_on_resident(tmp_path, storage, off, in_backward):
    data = batches(MLP, 3)
    ref = make_model()
    ref_opt = build_opt("AdamW", ref.parameters(), os.path.join(tmp_path, "ref-swap"), offload=off)
    train(ref, ref_opt, data, zero_through_data)
    model = offload(make_model(), storage, tmp_path)
    opt = build_opt("AdamW", model.parameters(), os.path.join(tmp_path, "swap"), offload=off, in_backward=in_backward)
    train(model, opt, data, zero_through_data)
    ref_opt.close()
    opt.close()
    remove_offload(model)
    got, want = weights(model), weights(ref)
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("scale", ["div_", "mul_", "itruediv", "foreach_div_"])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_grad_data_scaling_is_refused_naming_the_loss_and_a_hook(tmp_path, storage, scale):
    model = offload(make_model(), storage, tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path, offload="cpu")
    loss_of(model, batches(MLP, 1)[0]).backward()
    g = model.a.weight.grad.data
    with pytest.raises(RuntimeError, match=r"(?s)on p\.grad of the offloaded weight 'a\.weight'.*\(loss / n\)\.backward"
                                           r"\(\).*p\.register_hook"):
        {"div_": lambda: g.div_(2), "mul_": lambda: g.mul_(0.5), "itruediv": lambda: g.__itruediv__(2),
         "foreach_div_": lambda: torch._foreach_div_([g], 2.0)}[scale]()
    opt.close()
