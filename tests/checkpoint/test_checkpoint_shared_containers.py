"""A dict or list reached twice in a state (a config referenced from two places, a list-valued hyperparameter
every param group shares) loads as one object at both places, as torch.load gives it: a change through one place
is seen at the other after a resume as before it. A tampered reference is a ValueError naming the file."""
import io
import json

import pytest
import torch

import swapio.checkpoint as ckpt


def _torch_round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def _state():
    schedule = [0.1, 0.01]
    config = {"schedule": schedule, "w": torch.ones(2)}
    return {"groups": [{"lr": schedule}, {"lr": schedule}], "config": config, "again": config,
            "pair": (schedule, schedule), "own": [0.1, 0.01]}


def test_a_container_reached_twice_is_one_object_after_load_as_after_torch_load(tmp_path):
    state = _state()
    ckpt.save(state, tmp_path / "c.safetensors")
    back, ref = ckpt.load(tmp_path / "c.safetensors"), _torch_round_trip(state)
    for b in (back, ref):
        assert b["groups"][0]["lr"] is b["groups"][1]["lr"] is b["config"]["schedule"] is b["pair"][0]
        assert b["again"] is b["config"] and b["config"]["w"] is b["again"]["w"]
        assert b["own"] is not b["groups"][0]["lr"] and b["own"] == b["groups"][0]["lr"]
    assert torch.equal(back["config"]["w"], ref["config"]["w"])


def test_load_with_out_gives_the_shared_container_once_too(tmp_path):
    state = _state()
    ckpt.save(state, tmp_path / "c.safetensors")
    w = torch.zeros(2)
    back = ckpt.load(tmp_path / "c.safetensors", out={"config": {"w": w}})
    assert back["again"] is back["config"] and back["config"]["w"] is w and torch.equal(w, torch.ones(2))


def _rewrite_structure(path, edit):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"]["structure"] = json.dumps(edit(json.loads(header["__metadata__"]["structure"])))
    text = json.dumps(header).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n:])


@pytest.mark.parametrize("edit", [
    lambda s: {"D": [["a", {"R": 0}], ["b", {"L": [], "i": 0}]]},        # a reference before its list
    lambda s: {"D": [["a", {"L": [{"R": 0}], "i": 0}]]},                 # a list holding itself
    lambda s: {"D": [["a", {"R": "0"}]]},
    lambda s: {"D": [["a", {"L": [], "i": 0}], ["b", {"L": [], "i": 0}]]},  # the same id twice
])
def test_a_tampered_reference_is_a_value_error_naming_the_file(tmp_path, edit):
    path = tmp_path / "c.safetensors"
    ckpt.save({"pad": "x" * 200}, path)
    _rewrite_structure(path, edit)
    with pytest.raises(ValueError, match="c.safetensors.*structure"):
        ckpt.load(path)
