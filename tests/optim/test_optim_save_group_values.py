"""save() of param groups holding values a torch user may give (a NumPy lr, a flag given as 1): the checkpoint
stores what the step used, and load() resumes bit-identically to the uninterrupted run (the reference)."""
import numpy as np
import pytest
import torch

import swapio.optim as so
from helpers.optim import one_thread  # noqa: F401

MODES = ["cpu", "nvme"]
CASES = {
    "lr np.float64": {"lr": np.float64(1e-2)},
    "lr np.float32": {"lr": np.float32(1e-2)},
    "weight_decay np.float32": {"weight_decay": np.float32(0.1)},
    "eps np.float64": {"eps": np.float64(1e-6)},
    "betas np, edited mid-run": {"betas": (np.float32(0.8), np.float64(0.95))},
    "maximize 1": {"maximize": 1},
}
AT_CONSTRUCTION = {"amsgrad np.bool_": {"amsgrad": np.bool_(True)}}  # amsgrad cannot change once state exists


def _grads(step, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES) + list(AT_CONSTRUCTION))
def test_a_group_edited_to_such_values_saves_and_resumes_bit_identically(case, mode, tmp_path):
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    p = torch.randn(300, requires_grad=True)
    opt = so.OffloadAdamW([p], lr=1e-2, offload=mode, **AT_CONSTRUCTION.get(case, {}), **extra)
    p.grad = _grads(0, 300)
    opt.step()
    opt.param_groups[0].update(CASES.get(case, {}))  # what a config, a NumPy schedule or a hand edit leaves there
    p.grad = _grads(1, 300)
    opt.step()
    opt.save(tmp_path / "ckpt")
    q = p.detach().clone().requires_grad_(True)
    resumed = so.OffloadAdamW([q], offload=mode, **extra)
    resumed.load(tmp_path / "ckpt")
    for step in (2, 3):
        p.grad, q.grad = _grads(step, 300), _grads(step, 300)
        opt.step()
        resumed.step()
    assert torch.equal(p, q)
    opt.close()
    resumed.close()


@pytest.mark.parametrize("cls", ["OffloadAdam", "OffloadLion"])
def test_the_family_saves_numpy_hyperparameters(cls, tmp_path):
    p = torch.randn(50, requires_grad=True)
    opt = getattr(so, cls)([p], lr=np.float64(1e-3), weight_decay=np.float32(0.1), maximize=np.bool_(False))
    p.grad = _grads(0, 50)
    opt.step()
    opt.save(tmp_path / "ckpt")
    other = getattr(so, cls)([p.detach().clone().requires_grad_(True)], lr=5.0)
    other.load(tmp_path / "ckpt")
    group = other.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["maximize"]) == (float(np.float64(1e-3)),
                                                                     float(np.float32(0.1)), False)
    assert type(group["lr"]) is float and type(group["maximize"]) is bool


# What users keep beside the hyperparameters (a name, a layer's scale, a mask or a step tensor of their own): torch's
# state_dict() carries any of it
EXTRAS = {
    "tensor in a dict": {"layer": {"scale": torch.tensor([0.5, 2.0])}},
    "tensor in a list in a dict": {"layer": {"scales": [torch.tensor(0.5)]}},
    "int32 tensor": {"layer_id": torch.tensor(3, dtype=torch.int32)},
    "bool tensor": {"frozen": torch.tensor(False)},
}
TOO_LARGE = {"mask": torch.ones(2000)}


def _assert_same_value(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same_value(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same_value(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(EXTRAS))
def test_tensors_a_group_holds_beside_its_hyperparameters_save_and_load_back(case, mode, tmp_path):
    """save() wrote these and load() then refused the checkpoint (found only when resuming)."""
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    p = torch.randn(300, requires_grad=True)
    opt = so.OffloadAdamW([{"params": [p], **EXTRAS[case]}], lr=1e-2, offload=mode, **extra)
    p.grad = _grads(0, 300)
    opt.step()
    opt.save(tmp_path / "ckpt")
    resumed = so.OffloadAdamW([p.detach().clone().requires_grad_(True)], offload=mode, **extra)
    resumed.load(tmp_path / "ckpt")
    for key, value in EXTRAS[case].items():
        _assert_same_value(resumed.param_groups[0][key], value)
    opt.close()
    resumed.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_group_tensor_too_large_for_a_checkpoint_is_refused_by_save_not_by_load(mode, tmp_path):
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    p = torch.randn(300, requires_grad=True)
    opt = so.OffloadAdamW([p], lr=1e-2, offload=mode, **extra)
    p.grad = _grads(0, 300)
    opt.step()
    opt.save(tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "swapio-optim.safetensors").read_bytes()
    opt.param_groups[0].update(TOO_LARGE)
    with pytest.raises(ValueError, match=r"param group 0: 'mask' .*\(8000 bytes\).*state_dict\(\)"):
        opt.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "swapio-optim.safetensors").read_bytes() == before  # the last checkpoint stays
    opt.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_group_load_would_refuse_is_refused_by_save_and_the_last_checkpoint_stays(mode, tmp_path):
    """transformers.Adafactor's keys set in a group by an edit of param_groups: step() refuses them, and so did
    load(), but save() wrote the checkpoint, in place of the last loadable one."""
    extra = {"swap_dir": tmp_path / "swap"} if mode == "nvme" else {}
    p = torch.randn(30, 20, requires_grad=True)
    opt = so.OffloadAdafactor([p], offload=mode, **extra)
    p.grad = _grads(0, 600).view(30, 20)
    opt.step()
    opt.save(tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "swapio-optim.safetensors").read_bytes()
    opt.param_groups[0]["relative_step"] = False
    with pytest.raises(ValueError, match=r"swapio-optim.safetensors: not saved: param group 0: .*'relative_step'"):
        opt.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "swapio-optim.safetensors").read_bytes() == before
    del opt.param_groups[0]["relative_step"]
    resumed = so.OffloadAdafactor([p.detach().clone().requires_grad_(True)], offload=mode, **extra)
    resumed.load(tmp_path / "ckpt")  # the last checkpoint loads
    opt.close()
    resumed.close()
