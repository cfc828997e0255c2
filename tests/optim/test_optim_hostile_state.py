"""State from outside is validated before anything is installed: a checkpoint whose metadata was damaged or
forged, or a state dict with bad fields, raises ValueError naming the problem, and the optimizer goes on
exactly as if the load had not been tried (cpu and nvme)."""
import json
import math

import pytest
import torch

import swapio

import swapio.optim as so
from swapio.optim import checkpoint
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, assert_trains_like_fresh, make_opt, make_params, snapshot, train


def _file(ckpt):
    return ckpt / checkpoint.FILE


def _edit_structure(ckpt, edit):
    """Rewrites the checkpoint with its structure edited (swapio.checkpoint reads and writes it: a forged file
    as well formed as a save's)."""
    state = swapio.checkpoint.load(_file(ckpt))
    edit(state)
    swapio.checkpoint.save(state, _file(ckpt))


def _edit_header(ckpt, edit):
    """Edits the safetensors header's JSON in place, keeping its length (a forged or damaged header)."""
    with open(_file(ckpt), "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        edit(header)
        text = json.dumps(header).encode()
        assert len(text) <= n
        f.seek(8)
        f.write(text.ljust(n))


def _set(*keys, value):
    def edit(meta):
        d = meta
        for key in keys[:-1]:
            d = d[key]
        d[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(meta):
        d = meta
        for key in keys[:-1]:
            d = d[key]
        del d[keys[-1]]
    return edit


def _two_params_one_id(meta):
    meta["param_groups"][0]["params"][1] = meta["param_groups"][0]["params"][0]


def _two_params_one_id_consistent(meta):
    """As a group holding one parameter twice saves (its index twice, one state entry), for an optimizer whose
    group holds distinct parameters there."""
    _two_params_one_id(meta)
    for key in ("state", "param_dtypes", "checksums"):
        del meta[key][1]


def _transposed(meta):
    for name in ("exp_avg", "exp_avg_sq"):  # int8 codes; their block scales count the same
        meta["state"][1][name] = meta["state"][1][name].reshape(33, 17)


def _same_offsets(header):
    header["state.0.exp_avg_sq"]["data_offsets"] = header["state.0.exp_avg"]["data_offsets"]


def _past_the_end(header):
    begin, end = header["state.2.exp_avg"]["data_offsets"]
    header["state.2.exp_avg"]["data_offsets"] = [begin + (1 << 40), end + (1 << 40)]


STRUCTURE_DAMAGE = {
    "nan step": (_set("state", 0, "step", value=math.nan), "step"),
    "negative step": (_set("state", 0, "step", value=-3), "step"),
    "fractional step": (_set("state", 1, "step", value=2.5), "step"),
    "step not a number": (_set("state", 1, "step", value="3"), "step"),
    "step a tensor": (_set("state", 1, "step", value=torch.ones(2)), "step"),
    "missing int8 scale": (_drop("state", 0, "exp_avg_scale"), "exp_avg_scale"),
    "unknown field": (_set("state", 0, "exp_avg_cube", value=torch.zeros(3000, dtype=torch.uint8)), "exp_avg_cube"),
    "field not a tensor": (_set("state", 0, "exp_avg", value=0), "exp_avg"),
    "moment of another dtype": (_set("state", 0, "exp_avg", value=torch.zeros(3000)), "stores it as"),
    "moment of another size": (_set("state", 0, "exp_avg_sq", value=torch.zeros(2999, dtype=torch.uint8)),
                               "stores it as"),
    "shape of another parameter": (_transposed, "shape"),
    "parameter dtype": (_set("param_dtypes", 0, value="int64"), "dtype"),
    "checksum not hex": (_set("checksums", 0, "exp_avg", value="x"), "checksums"),
    "checksums missing": (_drop("checksums", 0), "checksums"),
    "state of no parameter": (_set("state", 99, value={"step": 1}), "99"),
    "one id twice": (_two_params_one_id, "not a parameter of 'param_groups'"),
    "one id twice, as a group holding one parameter twice saves": (_two_params_one_id_consistent, "distinct"),
    "state_dtype": (_set("state_dtype", value="int4"), "state_dtype"),
    "version": (_set("version", value="3"), "version"),
    "format": (_set("format", value="swapio.other"), "not a swapio optimizer checkpoint"),
    "param_groups": (_set("param_groups", value={"params": []}), "param_groups"),
    "lr": (_set("param_groups", 0, "lr", value=math.nan), "learning rate"),
    # a one-element tensor lr loads (as torch's state_dict holds it: test_optim_checkpoint_hostile); others not
    "a two-element tensor as lr": (_set("param_groups", 0, "lr", value=torch.ones(2)), "one-element tensor"),
    "a tensor as a parameter index": (_set("param_groups", 0, "params", 0, value=torch.tensor(0)), "plain value"),
    "a tensor as the state_dtype": (_set("state_dtype", value=torch.tensor(0)), "plain value"),
}
HEADER_DAMAGE = {
    "overlapping arrays": (_same_offsets, "overlaps"),
    "array past the end": (_past_the_end, "truncated"),
    "structure not JSON": (lambda h: h["__metadata__"].__setitem__("structure", "{"), "malformed"),
    "array of another dtype": (lambda h: h["state.0.exp_avg"].__setitem__("dtype", "I8"), "stores it as"),
}


def _intact_after(opt, params, failing_load, tmp_path, state_dtype):
    before = snapshot(opt, params)
    failing_load()
    assert_same(snapshot(opt, params), before)
    # training goes on as if the load had not been tried
    assert_trains_like_fresh(opt, params, 3, 4, tmp_path, state_dtype=state_dtype)


def _trained_int8(mode, tmp_path):
    params = make_params()
    opt = make_opt("adamw", params, mode, tmp_path, "int8")
    train(opt, params, 1, 2)
    return params, opt


def _refused_and_intact(opt, params, load, named, tmp_path):
    """load() raises a ValueError naming `named`, and the int8 optimizer trains on as if it had not been tried."""
    def failing_load():
        with pytest.raises(ValueError, match=named):
            load()

    _intact_after(opt, params, failing_load, tmp_path, "int8")
    opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(STRUCTURE_DAMAGE) + sorted(HEADER_DAMAGE))
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_damaged_checkpoint_metadata_is_refused_and_the_state_kept(mode, damage, tmp_path):
    edit, named = STRUCTURE_DAMAGE.get(damage) or HEADER_DAMAGE[damage]
    params, opt = _trained_int8(mode, tmp_path)
    ckpt = tmp_path / "ckpt"
    opt.save(ckpt)
    (_edit_structure if damage in STRUCTURE_DAMAGE else _edit_header)(ckpt, edit)

    _refused_and_intact(opt, params, lambda: opt.load(ckpt), named, tmp_path)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_integer_steps_load_as_torch_accepts_them(mode, tmp_path):
    """Older torch wrote steps as ints; load() and load_state_dict() take them."""
    params = make_params()
    opt = make_opt("adamw", params, mode, tmp_path)
    train(opt, params, 1, 2)
    ckpt = tmp_path / "ckpt"
    opt.save(ckpt)
    sd = opt.state_dict()
    _edit_structure(ckpt, lambda meta: [st.__setitem__("step", 2) for st in meta["state"].values()])
    opt.load(ckpt)
    sd = {"param_groups": sd["param_groups"], "state": {k: {**st, "step": 2} for k, st in sd["state"].items()}}
    opt.load_state_dict(sd)
    assert_trains_like_fresh(opt, params, 3, 4, tmp_path)
    opt.close()


def _nan_at(name):
    def edit(states):
        states[0][name] = states[0][name].clone()
        states[0][name].view(-1)[5] = math.nan
    return edit


def _entry_set(name, value):
    return lambda states: states[0].__setitem__(name, value)


STATE_DICT_DAMAGE = {
    "nan step": (_entry_set("step", torch.tensor(math.nan)), "step"),
    "negative step": (_entry_set("step", torch.tensor(-1.0)), "step"),
    "step None": (_entry_set("step", None), "step"),
    "negative second moment": (_entry_set("exp_avg_sq", -torch.ones(3000)), "exp_avg_sq"),
    "moment of another size": (_entry_set("exp_avg", torch.zeros(2999)), "exp_avg"),
    "moment not a tensor": (_entry_set("exp_avg", [0.0] * 3000), "exp_avg"),
    "integer moment": (_entry_set("exp_avg", torch.zeros(3000, dtype=torch.int32)), "exp_avg"),
    "nan scale": (_nan_at("exp_avg_scale"), "exp_avg_scale"),
    "negative scale": (_entry_set("exp_avg_sq_scale", -torch.ones(12)), "exp_avg_sq_scale"),
    "scale of another size": (_entry_set("exp_avg_scale", torch.ones(11)), "exp_avg_scale"),
    "entry not a dict": (lambda states: states.__setitem__(0, [1.0]), "dict"),
    "no step": (lambda states: states[0].pop("step"), "step"),
}


@pytest.mark.parametrize("damage", sorted(STATE_DICT_DAMAGE))
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_bad_state_dict_is_refused_and_the_state_kept(mode, damage, tmp_path):
    edit, named = STATE_DICT_DAMAGE[damage]
    params, opt = _trained_int8(mode, tmp_path)
    sd = opt.state_dict()
    sd = {"param_groups": sd["param_groups"], "state": {k: dict(st) for k, st in sd["state"].items()}}
    edit(sd["state"])

    _refused_and_intact(opt, params, lambda: opt.load_state_dict(sd), named, tmp_path)


@pytest.mark.parametrize("via", ["state_dict", "save"])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_a_run_whose_moments_overflowed_resumes_like_torch(mode, via, tmp_path):
    """g * g = inf leaves exp_avg_sq infinite in torch's AdamW and in fp32 state: such a state is not hostile, and a
    run that met it resumes (state_dict round trip, as Trainer does, and save/load) with the same values."""
    p = torch.nn.Parameter(torch.ones(3000))
    opt = swapio.optim.OffloadAdamW([p], lr=1e-3, offload=mode, swap_dir=str(tmp_path))
    p.grad = torch.ones(3000)
    p.grad[7] = 3e38
    opt.step()
    sd = opt.state_dict()
    assert torch.isinf(sd["state"][0]["exp_avg_sq"][7])
    q = torch.nn.Parameter(p.detach().clone())
    other = swapio.optim.OffloadAdamW([q], lr=1e-3, offload=mode, swap_dir=str(tmp_path))
    if via == "state_dict":
        other.load_state_dict(sd)
    else:
        opt.save(str(tmp_path / "ckpt"))
        other.load(str(tmp_path / "ckpt"))
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(other.state_dict()["state"][0][name], sd["state"][0][name])
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    ref.load_state_dict(sd)  # torch takes it as it is
    opt.close(); other.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("field", ["exp_avg", "step"])
def test_a_state_dict_on_the_meta_device_is_refused_naming_it_and_the_state_kept(field, mode, tmp_path):
    """A state dict read with map_location="meta" (or made under torch.device("meta")) holds no values: loading
    it failed with torch's bare "Cannot copy out of meta tensor; no data!" (or "item() cannot be called on meta
    tensors")."""
    p = torch.randn(4, 5, requires_grad=True)
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    opt = so.OffloadAdamW([p], offload=mode, **extra)
    p.grad = torch.ones(4, 5)
    opt.step()
    before = {k: t.clone() for k, t in opt.state_dict()["state"][0].items()}
    sd = opt.state_dict()
    sd["state"][0] = {**sd["state"][0], field: torch.empty_like(sd["state"][0][field], device="meta")}
    with pytest.raises(ValueError, match=rf"parameter 0: '{field}' is on the meta device, which holds no values"):
        opt.load_state_dict(sd)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], t) for k, t in before.items())
    opt.close()
