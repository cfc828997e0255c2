"""p.grad of an offloaded weight assigned a tensor of the user's: `p.grad = torch.zeros_like(p)` for the weights
that got no gradient (code that fills in missing gradients before an all-reduce, or for unused MoE experts). The
tensor is meta (no values the optimizer could read) and step() dropped it without a word, where torch steps with
it: Adam's moments and the weight decay still move a weight whose .grad is zero, so the weights drifted from the
resident model's. step() and opt.clip_grad_norm_ now raise a RuntimeError naming the weight before anything
changed; with p.grad back to None the step goes on as torch's skips a parameter without .grad."""
import pytest
import torch

from helpers.offload_training import MLP, batches, build_opt, loss_of, make_model, offload, one_thread, weights
from swapio.offload import remove_offload

pytest.importorskip("safetensors")


def only_c(model, batch):
    """A loss that reaches only model.c: the other weights get no gradient."""
    return torch.nn.functional.mse_loss(model.c(torch.ones(5, 16)), batch[1])


@pytest.mark.parametrize("when", ["step", "clip"])
@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
def test_assigned_grad_is_refused_before_anything_changed(tmp_path, storage, off, when):
    data = batches(MLP, 2)
    ref = make_model()
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref-swap", offload=off)
    model = offload(make_model(), storage, tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off)
    with one_thread():
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_of(m, data[0]).backward()
            o.step()
            o.zero_grad()
            only_c(m, data[1]).backward()
        model.a.weight.grad = torch.zeros_like(model.a.weight)
        with pytest.raises(RuntimeError, match=r"(?s)p\.grad of the offloaded weight 'a\.weight' was assigned a tensor"
                                               r".*p\.grad = None"):
            opt.step() if when == "step" else opt.clip_grad_norm_(1.0)
        model.a.weight.grad = None  # as the resident model's, which got none
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    ref_opt.close()
    opt.close()
    remove_offload(model)
    got, want = weights(model), weights(ref)
    assert all(torch.equal(got[n], want[n]) for n in want)
