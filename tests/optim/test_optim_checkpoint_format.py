"""opt.save(dir) writes one safetensors file with swapio.checkpoint's writer: other readers take it
(safetensors.torch.load_file), swapio.checkpoint.load gives it back as an optimizer state dict of the arrays as
stored, and the checkpoints earlier swapio versions wrote (format version 3: swapio-optim.pt + a .bin) still
load."""
import os
import shutil

import pytest
import safetensors.torch
import torch

import swapio
from swapio.optim import checkpoint
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, make_opt, make_params, snapshot, train

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "optim-v3")
V3_SHAPES = [(300,), (17, 33), (513,)]


def _saved(mode, state_dtype, dtype, tmp_path):
    params = make_params(dtype=dtype)
    opt = make_opt("adamw", params, mode, tmp_path, state_dtype)
    train(opt, params, 1, 2)
    opt.save(tmp_path / "ckpt")
    return opt, params, tmp_path / "ckpt" / checkpoint.FILE


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_fp32_state_is_a_safetensors_file_of_the_state_dict(mode, tmp_path):
    opt, _, file = _saved(mode, "fp32", torch.bfloat16, tmp_path)
    assert os.listdir(file.parent) == [checkpoint.FILE]
    tensors = safetensors.torch.load_file(file)
    sd = opt.state_dict()
    expected = {f"state.{k}.{name}": t for k, st in sd["state"].items() for name, t in st.items() if name != "step"}
    assert tensors.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(tensors[name], t), name
    loaded = swapio.checkpoint.load(file)
    assert loaded["format"] == checkpoint.FORMAT and loaded["version"] == checkpoint.VERSION
    assert loaded["optimizer"] == "OffloadAdamW" and loaded["state_dtype"] == "fp32"
    assert loaded["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        assert loaded["state"][k]["step"] == int(st["step"].item())
        assert loaded["param_dtypes"][k] == "bfloat16"
        assert set(loaded["checksums"][k]) == set(st) - {"step"}
        for name, t in st.items():
            if name != "step":
                assert torch.equal(loaded["state"][k][name], t), (k, name)
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_low_precision_state_is_stored_as_the_optimizer_stores_it(mode, state_dtype, tmp_path):
    opt, params, file = _saved(mode, state_dtype, torch.float32, tmp_path)
    tensors = safetensors.torch.load_file(file)
    sd = opt.state_dict()  # fp32, decoded from the stored arrays
    fmt = opt.state_format
    for k, st in sd["state"].items():
        stored = {name: tensors[f"state.{k}.{name}"] for name in opt.exported_fields()[params[k]]}
        for name, t in stored.items():
            assert t.dtype == fmt.dtype(name), (k, name)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fmt.decode({n: v.reshape(-1) for n, v in stored.items()}, name),
                               st[name].reshape(-1)), (k, name)
    opt.close()


def test_an_int8_checkpoint_read_as_a_state_dict_says_to_load_its_directory(tmp_path):
    """swapio.checkpoint.load(file) gives the arrays as stored: int8 moments are codes, not values (torch's
    load_state_dict would take them as moments); ours says how to load the checkpoint instead of 'must be a
    floating-point tensor'."""
    opt, params, file = _saved("cpu", "int8", torch.float32, tmp_path)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"8-bit codes.*opt\.load\(dir\)"):
        opt.load_state_dict(swapio.checkpoint.load(file))
    assert_same(snapshot(opt, params), before)
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("name, dtype, state_dtype", [("bf16-params-fp32-state", torch.bfloat16, "fp32"),
                                                      ("int8-state", torch.float32, "int8")])
def test_version_3_checkpoints_load_and_the_next_save_replaces_them(mode, name, dtype, state_dtype, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, name), ckpt)
    expected = torch.load(os.path.join(DATA, name + ".expected.pt"), weights_only=True)
    params = make_params(dtype=dtype, shapes=V3_SHAPES)
    opt = make_opt("adamw", params, mode, tmp_path, state_dtype)
    opt.load(ckpt)
    now = snapshot(opt, params)
    assert now["groups"] == expected["groups"]
    assert_same({**now, "params": []}, {**expected, "params": []})
    opt.save(ckpt)  # the newest commit wins: the old files go once it is in place
    assert os.listdir(ckpt) == [checkpoint.FILE]
    other = make_opt("adamw", [p.detach().clone().requires_grad_(True) for p in params], mode, tmp_path,
                     state_dtype)
    other.load(ckpt)
    assert_same({**snapshot(other, params), "params": []}, {**now, "params": []})
    opt.close()
    other.close()


def test_a_new_checkpoint_beside_an_old_one_wins(tmp_path):
    """A save killed after its commit but before it removed a version 3 checkpoint leaves both: the new loads."""
    ckpt = tmp_path / "ckpt"
    opt, params, file = _saved("cpu", "fp32", torch.float32, tmp_path)
    for name in os.listdir(os.path.join(DATA, "int8-state")):
        shutil.copy(os.path.join(DATA, "int8-state", name), ckpt)
    other = make_opt("adamw", [p.detach().clone().requires_grad_(True) for p in params], "cpu", tmp_path)
    other.load(ckpt)
    assert_same(snapshot(other, params), snapshot(opt, params))
    opt.close()
    other.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_zero_dimensional_and_empty_parameters_round_trip(mode, tmp_path):
    shapes = [(), (0,), (5,)]
    params = [torch.ones(s, requires_grad=True) for s in shapes]
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    opt = swapio.optim.OffloadAdamW(params, offload=mode, **extra)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    opt.save(tmp_path / "ckpt")
    other = swapio.optim.OffloadAdamW([p.detach().clone().requires_grad_(True) for p in params], offload=mode,
                                      **extra)
    other.load(tmp_path / "ckpt")
    assert_same({**snapshot(other, params), "params": []}, {**snapshot(opt, params), "params": []})
    opt.close()
    other.close()


def _set_field(key, value):
    return lambda meta: meta["state"][0]["fields"].__setitem__(key, value)


LEGACY_DAMAGE = {
    "data outside the directory": (lambda meta: meta.__setitem__("data", "../swapio-optim-00.bin"), "data"),
    "data_bytes not an integer": (lambda meta: meta.__setitem__("data_bytes", 1.5), "data_bytes"),
    "negative offset": (_set_field("exp_avg", -4096), "offset"),
    "offset past the end": (_set_field("exp_avg", 1 << 40), "outside"),
    "overlapping arrays": (lambda meta: _set_field("exp_avg", meta["state"][0]["fields"]["exp_avg_sq"])(meta),
                           "overlap"),
}


@pytest.mark.parametrize("damage", sorted(LEGACY_DAMAGE))
def test_damaged_version_3_metadata_is_refused_and_the_state_kept(damage, tmp_path):
    edit, named = LEGACY_DAMAGE[damage]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "int8-state"), ckpt)
    meta = torch.load(ckpt / checkpoint.LEGACY_META, weights_only=True)
    edit(meta)
    torch.save(meta, ckpt / checkpoint.LEGACY_META)
    params = make_params(shapes=V3_SHAPES)
    opt = make_opt("adamw", params, "cpu", tmp_path, "int8")
    train(opt, params, 1, 1)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=named):
        opt.load(ckpt)
    assert_same(snapshot(opt, params), before)
    opt.close()
