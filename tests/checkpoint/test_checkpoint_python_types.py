"""What torch.save / torch.load keep of a state's Python types, swapio.checkpoint keeps too, or refuses loudly:
nn.Parameter and requires_grad, torch.Size, and subclasses of the containers and values it stores (a defaultdict,
an OrderedDict subclass such as transformers' ModelOutput, an IntEnum key), which would otherwise come back as
their base type without a word."""
import collections
import enum
import io
import os
import sys

import pytest
import torch

import swapio.checkpoint as ckpt


def _torch_round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_parameters_and_requires_grad_come_back_as_torch_load_gives_them(tmp_path):
    w = torch.nn.Parameter(torch.randn(3, 2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    leaf = torch.randn(4, requires_grad=True)
    state = {"w": w, "tied": w, "frozen": frozen, "leaf": leaf, "nonleaf": leaf * 2, "plain": torch.ones(2),
             "data": w.detach()}
    ref = _torch_round_trip(state)
    ckpt.save(state, tmp_path / "c.safetensors")
    back = ckpt.load(tmp_path / "c.safetensors")
    for key, expected in ref.items():
        got = back[key]
        assert type(got) is type(expected), key
        assert (got.requires_grad, got.is_leaf) == (expected.requires_grad, expected.is_leaf), key
        assert torch.equal(got.detach(), expected.detach()), key
    assert back["tied"] is back["w"]  # one parameter at both places, as torch.load gives it
    assert back["data"] is not back["w"]
    opt = torch.optim.SGD([back["w"]], lr=1.0)  # a loaded parameter trains
    back["w"].sum().backward()
    opt.step()
    assert torch.equal(back["w"].detach(), ref["w"].detach() - 1)


def test_torch_size_comes_back_as_torch_size(tmp_path):
    state = {"shape": torch.Size([3, 4]), "empty": torch.Size([]), "view_arg": torch.Size([-1, 2])}
    ckpt.save(state, tmp_path / "c.safetensors")
    back = ckpt.load(tmp_path / "c.safetensors")
    ref = _torch_round_trip(state)
    assert back == ref and all(type(back[k]) is torch.Size for k in state)


class _Color(enum.IntEnum):
    RED = 1


class _Output(collections.OrderedDict):
    pass


class _Tagged(list):
    pass


class _Pair(tuple):
    pass


class _Name(str):
    pass


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("state, what", [
    ({"a": collections.defaultdict(list, {"x": 1})}, "defaultdict"),
    ({"a": _Output(x=torch.ones(1))}, "_Output"),
    ({"a": _Tagged([1])}, "_Tagged"),
    ({"a": _Pair((1,))}, "_Pair"),
    ({_Color.RED: 1}, "_Color"),
    ({_Name("k"): 1}, "_Name"),
    ({"a": torch.ones(2).as_subclass(_Subclass)}, "_Subclass"),
])
def test_subclasses_that_would_come_back_as_their_base_are_a_type_error_naming_them(tmp_path, state, what):
    (key, value), = state.items()
    (back_key, back_value), = _torch_round_trip(state).items()
    assert (type(back_key), type(back_value)) == (type(key), type(value))  # torch.load keeps them: the reference
    with pytest.raises(TypeError, match=what):
        ckpt.save(state, tmp_path / "c.safetensors")
    assert not os.listdir(tmp_path)


def test_out_may_hold_container_subclasses_and_parameters(tmp_path):
    model = torch.nn.Linear(3, 2)
    state = {"model": {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}}
    ckpt.save(state, tmp_path / "c.safetensors")
    out = {"model": collections.OrderedDict(model.named_parameters())}  # Parameters, as state_dict(keep_vars=True)
    out = collections.defaultdict(dict, out)
    ckpt.load(tmp_path / "c.safetensors", out=out)
    assert torch.equal(model.weight.detach(), state["model"]["weight"])


def test_an_int_too_long_for_json_is_a_value_error_naming_its_key_before_any_file(tmp_path):
    limit = getattr(sys, "get_int_max_str_digits", int)()
    if not limit:
        pytest.skip("no int digit limit in this interpreter")
    with pytest.raises(ValueError, match=r"state\['big'\]"):
        ckpt.save({"big": 10 ** (limit + 1)}, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"state: dict key"):
        ckpt.save({10 ** (limit + 1): 1}, tmp_path / "c.safetensors")
    assert not os.listdir(tmp_path)


def test_a_meta_tensor_in_out_is_refused_as_having_no_memory_to_load_into(tmp_path):
    ckpt.save({"w": torch.ones(2)}, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="out=.*meta"):
        ckpt.load(tmp_path / "c.safetensors", out={"w": torch.empty(2, device="meta")})


def test_a_bytes_path_works_as_its_str(tmp_path):
    path = os.fsencode(tmp_path / "c.safetensors")
    ckpt.save({"w": torch.arange(3.0)}, path)
    assert torch.equal(ckpt.load(path)["w"], torch.arange(3.0))
    ckpt.async_save({"w": torch.arange(4.0)}, path).wait()
    assert torch.equal(ckpt.load(os.fsdecode(path))["w"], torch.arange(4.0))


def test_a_tampered_size_is_a_value_error_naming_the_file_and_out_is_unchanged(tmp_path):
    path = tmp_path / "c.safetensors"
    ckpt.save({"w": torch.ones(2), "s": torch.Size([7])}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].replace(b'{\\"S\\":[7]}', b'{\\"S\\":[9223372036854775808]}').rstrip(b" ")
    assert len(header) <= n and header != raw[8:8 + n].rstrip(b" ")  # (the padding takes the longer number)
    path.write_bytes(raw[:8] + header.ljust(n, b" ") + raw[8 + n:])
    out = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="c.safetensors.*'S'"):
        ckpt.load(path, out=out)
    assert torch.equal(out["w"], torch.zeros(2))


def test_a_multisteplr_resumes_with_its_counter_of_milestones(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 2, 4], gamma=0.5)  # (a Counter: 2 counts twice)
    for _ in range(4):
        opt.step()
        sched.step()
    ckpt.save({"sched": sched.state_dict()}, tmp_path / "c.safetensors")
    ref = _torch_round_trip({"sched": sched.state_dict()})
    back = ckpt.load(tmp_path / "c.safetensors")
    assert type(back["sched"]["milestones"]) is type(ref["sched"]["milestones"]) is collections.Counter
    assert back["sched"] == ref["sched"]
    resumed = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1])
    resumed.load_state_dict(back["sched"])
    assert resumed._get_closed_form_lr() == [0.125]  # (uses milestones.elements(), which a dict lacks)


def test_a_state_dicts_module_versions_come_back_as_torch_load_gives_them(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.InstanceNorm1d(3))
    state = {"model": model.state_dict()}
    ckpt.save(state, tmp_path / "c.safetensors")
    back, ref = ckpt.load(tmp_path / "c.safetensors"), _torch_round_trip(state)
    assert ref["model"]._metadata["1"]["version"] == 2  # (what load_state_dict gives BatchNorm's loader)
    assert back["model"]._metadata == ref["model"]._metadata
    out = {"model": model.state_dict()}
    assert ckpt.load(tmp_path / "c.safetensors", out=out)["model"]._metadata == ref["model"]._metadata
    model.load_state_dict(back["model"])
