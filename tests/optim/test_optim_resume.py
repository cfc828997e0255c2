"""Resuming is bit-identical to never stopping: train, take the state (state_dict() through torch.save and
torch.load, as HF Trainer and accelerate do, or save()), build a fresh optimizer on the same parameters, load it,
train on, and compare everything with an uninterrupted run (every state_dtype, both modes and across them, Adam
and Lion)."""
import io

import pytest
import torch

from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_trains_like_fresh, make_opt, make_params, train

MODES = [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")]


def _through_torch_save(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(kind, state_dtype, first_mode, second_mode, how, tmp_path):
    params = make_params()
    opt = make_opt(kind, params, first_mode, tmp_path, state_dtype)
    train(opt, params, 1, 3)
    if how == "state_dict":
        state = _through_torch_save(opt.state_dict())
    else:
        opt.save(tmp_path / "ckpt")
    opt.close()
    resumed_params = [p.detach().clone().requires_grad_(True) for p in params]
    resumed = make_opt(kind, resumed_params, second_mode, tmp_path, state_dtype)
    if how == "state_dict":
        resumed.load_state_dict(state)
    else:
        resumed.load(tmp_path / "ckpt")
    assert_trains_like_fresh(resumed, resumed_params, 4, 6, tmp_path, kind, state_dtype)
    resumed.close()


@pytest.mark.parametrize("how", ["state_dict", "save"])
@pytest.mark.parametrize("first_mode, second_mode", MODES)
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_adamw_resume_is_bit_identical(state_dtype, first_mode, second_mode, how, tmp_path):
    _resume("adamw", state_dtype, first_mode, second_mode, how, tmp_path)


@pytest.mark.parametrize("how", ["state_dict", "save"])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_lion_resume_is_bit_identical(state_dtype, mode, how, tmp_path):
    _resume("lion", state_dtype, mode, mode, how, tmp_path)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_int8_state_dict_with_changed_moments_is_quantised_afresh(mode, tmp_path):
    """The exported scales are used only where the moments are exactly their codes times those scales: moments
    changed after the export (here doubled) are quantised as an fp32 state dict's would be."""
    from swapio import quant

    params = make_params()
    opt = make_opt("adamw", params, mode, tmp_path, "int8")
    train(opt, params, 1, 2)
    sd = _through_torch_save(opt.state_dict())
    assert sd["state"][0]["exp_avg_scale"].shape == (quant.num_blocks(params[0].numel()),)
    for st in sd["state"].values():
        st["exp_avg"] *= 2
    opt.load_state_dict(sd)
    got = opt.state_dict()["state"]
    for i, st in sd["state"].items():
        codes, scale = quant.quantize(st["exp_avg"], signed=True)
        assert torch.equal(got[i]["exp_avg_scale"], scale)
        assert torch.equal(got[i]["exp_avg"].view(-1), quant.dequantize(codes, scale, signed=True))
        assert torch.equal(got[i]["exp_avg_sq"], st["exp_avg_sq"])  # unchanged: re-imported exactly
    opt.close()
