"""torch.distributed.checkpoint.state_dict's get_state_dict(model, optimizer) of a one-process model saved with
swapio.checkpoint and given back with set_state_dict resumes training exactly as torch.save/torch.load's copy does
(both as a new structure and loaded in place with out=)."""
import io

import pytest
import torch

import swapio.checkpoint as ckpt

sd = pytest.importorskip("torch.distributed.checkpoint.state_dict")


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt):
    model(torch.ones(3, 8)).sum().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def test_get_state_dict_round_trips_as_through_torch_save(tmp_path):
    msd, osd = sd.get_state_dict(*_trained())
    buf = io.BytesIO()
    torch.save({"model": msd, "optim": osd}, buf)
    buf.seek(0)
    ref_state = torch.load(buf)
    ckpt.save({"model": msd, "optim": osd}, tmp_path / "c.safetensors")

    ref_model, ref_opt = _fresh()
    sd.set_state_dict(ref_model, ref_opt, model_state_dict=ref_state["model"], optim_state_dict=ref_state["optim"])
    expected, expected_opt = _step(ref_model, ref_opt)

    back = ckpt.load(tmp_path / "c.safetensors")
    model, opt = _fresh()
    sd.set_state_dict(model, opt, model_state_dict=back["model"], optim_state_dict=back["optim"])
    got, got_opt = _step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert got_opt["param_groups"] == expected_opt["param_groups"]

    model, opt = _fresh()  # in place: the fresh model's own state dict as out=
    model(torch.zeros(1, 8)).sum().backward()
    opt.step()  # (so that the optimizer has state tensors to load into)
    opt.zero_grad()
    msd2, osd2 = sd.get_state_dict(model, opt)
    ckpt.load(tmp_path / "c.safetensors", out={"model": msd2, "optim": osd2})
    sd.set_state_dict(model, opt, model_state_dict=msd2, optim_state_dict=osd2)
    got, _ = _step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
