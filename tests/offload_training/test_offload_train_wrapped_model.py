"""An offloaded model put under a module of the user's own (a backbone and a new head) with the optimizer built from
that module's parameters at once, before any forward: swapio shows stand-ins for the offloaded weights until the
model's next forward (grafting.py), and the optimizer took them for resident parameters, so the first backward
raised "no swapio optimizer owns it", naming the very thing the user had done. Now the optimizer takes each
stand-in for its weight's placeholder, and training equals the resident model's exactly."""
import pytest
import torch

from helpers.offload_training import MLP, WithHead, batches, make_model, offload, train, weights
from swapio.offload import remove_offload
from swapio.optim import OffloadAdamW

pytest.importorskip("safetensors")


@pytest.mark.parametrize("storage,off,in_backward", [("disk", "nvme", False), ("cpu", "cpu", False),
                                                     ("ckpt", "cpu", True)])
def test_optimizer_built_from_a_wrapper_before_any_forward_trains_as_resident(tmp_path, storage, off, in_backward):
    data = batches(MLP, 3)
    ref = WithHead(make_model(), (4, 4))
    with OffloadAdamW(ref.parameters(), lr=1e-2, offload=off, swap_dir=str(tmp_path)) as ref_opt:
        want = train(ref, ref_opt, data)
    model = WithHead(offload(make_model(), storage, tmp_path), (4, 4))
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload=off, swap_dir=str(tmp_path), in_backward=in_backward)
    got = train(model, opt, data)
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())  # the placeholders
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    opt.close()
    remove_offload(model.backbone)
    got_w, want_w = weights(model), weights(ref)
    assert all(torch.equal(got_w[n], want_w[n]) for n in want_w)
