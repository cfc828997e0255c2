"""load(out=) puts each saved tensor into the out= tensor at the same place (keys and indices) as torch.load's
structure has it, even where two places share a name (save makes the second unique with '#n'), whatever order
out= lists them in; a place that does not match is refused before anything is written."""
import io

import pytest
import torch

import swapio.checkpoint as ckpt


def _torch_round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("saved, out", [
    ({"a.b": 1.0, "a": {"b": 2.0}}, lambda z: {"a": {"b": z()}, "a.b": z()}),
    ({0: 1.0, "0": 2.0}, lambda z: {"0": z(), 0: z()}),
    ({"x": [1.0, 2.0], "x.1": 3.0}, lambda z: {"x.1": z(), "x": [z(), z()]}),
])
def test_places_sharing_a_name_load_into_the_same_place_in_any_order(tmp_path, saved, out):
    def tensors(x):
        if isinstance(x, dict):
            return {k: tensors(v) for k, v in x.items()}
        if isinstance(x, list):
            return [tensors(v) for v in x]
        return torch.full((2,), x)

    state = tensors(saved)
    ckpt.save(state, tmp_path / "c.safetensors")
    given = out(lambda: torch.zeros(2))
    ckpt.load(tmp_path / "c.safetensors", out=given)
    ref = _torch_round_trip(state)

    def check(got, expected):
        if isinstance(expected, dict):
            for k in expected:
                check(got[k], expected[k])
        elif isinstance(expected, list):
            for g, e in zip(got, expected):
                check(g, e)
        else:
            assert torch.equal(got, expected)

    check(given, ref)


def test_a_renamed_tensor_at_another_place_in_out_is_refused_before_anything_is_written(tmp_path):
    ckpt.save({"a.b": torch.ones(2), "a": {"b": torch.full((2,), 2.0)}}, tmp_path / "c.safetensors")
    out = {"a.b": torch.zeros(2), "c": {"d": torch.zeros(2)}}
    out["a.b#1"] = out.pop("c")["d"]  # the right names, one of them at another place
    with pytest.raises(ValueError, match=r"missing \[\"a\.b#1 \(at state\['a'\]\['b'\]\)\"\]"):
        ckpt.load(tmp_path / "c.safetensors", out=out)
    assert all(torch.equal(t, torch.zeros(2)) for t in out.values())


def test_a_flat_out_still_loads_a_file_of_names_without_renames(tmp_path):
    ckpt.save({"model": {"w": torch.ones(2)}}, tmp_path / "c.safetensors")
    out = {"model.w": torch.zeros(2)}  # matched by name, as before
    ckpt.load(tmp_path / "c.safetensors", out=out)
    assert torch.equal(out["model.w"], torch.ones(2))
