"""int8 codes in optimizer.state[p] changed outside the optimizer (cpu mode: zero_(), torch's way to reset a
momentum, or a new zero tensor) are refused by state_dict() and save() as by step(): they exported the codes as
moments (code 0 as about -1 x the block's scale), and a run resumed from that checkpoint went on from them
silently. The refusal says what works (del opt.state[p], or load_state_dict() of fp32 moments), which the export
then follows exactly as torch's state dict of a freshly started parameter would."""
import pytest
import torch

import swapio.optim as so


def _trained(tmp_path):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(300, generator=gen).requires_grad_(), torch.randn(20, 30, generator=gen).requires_grad_()]
    opt = so.OffloadAdamW(params, lr=1e-2, state_dtype="int8")
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize("edit", ["zero_", "replaced"])
@pytest.mark.parametrize("export", ["state_dict", "save"])
def test_int8_codes_changed_outside_the_optimizer_are_not_exported_as_moments(export, edit, tmp_path):
    params, opt = _trained(tmp_path)
    p = params[1]
    if edit == "zero_":
        opt.state[p]["exp_avg"].zero_()
    else:
        opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
    with pytest.raises(RuntimeError, match=r"(?s)parameter 1 .*'exp_avg'.*codes, not values.*del opt.state\[p\]"):
        opt.state_dict() if export == "state_dict" else opt.save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    del opt.state[p]  # the way the message names: that parameter starts afresh, as in torch
    sd = opt.state_dict()
    assert list(sd["state"]) == [0]
    opt.save(tmp_path / "ckpt")
    opt.close()


def test_int8_codes_the_optimizer_wrote_still_export(tmp_path):
    params, opt = _trained(tmp_path)
    first = opt.state_dict()
    opt.load_state_dict(first)  # new code tensors from a load are the optimizer's own
    again = opt.state_dict()
    for i in first["state"]:
        for name, t in first["state"][i].items():
            assert torch.equal(t, again["state"][i][name]), name
    opt.save(tmp_path / "ckpt")
    opt.close()
