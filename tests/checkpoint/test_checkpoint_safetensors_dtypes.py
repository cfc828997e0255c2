"""Files the safetensors library writes with dtype names swapio does not write itself (F8_E8M0 and F4, from
safetensors >= 0.6) load as safetensors.torch.load_file gives them; a dtype swapio cannot load is a ValueError
naming it."""
import json
import struct

import pytest
import torch

import swapio.checkpoint as ckpt

st = pytest.importorskip("safetensors.torch")


@pytest.mark.parametrize("dtype", ["float8_e8m0fnu", "float4_e2m1fn_x2"])
def test_dtypes_newer_safetensors_writes_load_as_load_file_gives_them(tmp_path, dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    t = torch.randint(0, 256, (3, 4), dtype=torch.uint8).view(getattr(torch, dtype))
    try:
        st.save_file({"t": t, "big": t.repeat(1 << 17, 1)}, tmp_path / "f.safetensors")
    except Exception as exc:  # an older safetensors without the name
        pytest.skip(f"this safetensors cannot write {dtype}: {exc}")
    ref = st.load_file(tmp_path / "f.safetensors")
    back = ckpt.load(tmp_path / "f.safetensors")
    assert list(back) == list(ref) or set(back) == set(ref)
    for name, expected in ref.items():
        assert back[name].dtype == expected.dtype and back[name].shape == expected.shape
        assert torch.equal(back[name].view(torch.uint8), expected.view(torch.uint8))


def _file(tmp_path, header, data):
    raw = json.dumps(header).encode()
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_dtype_swapio_cannot_load_is_a_value_error_naming_it(tmp_path):
    path = _file(tmp_path, {"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, bytes(3))
    with pytest.raises(ValueError, match="tensor 'a' has dtype 'F6_E2M3', which swapio cannot load"):
        ckpt.load(path)


def test_an_f4_tensor_of_an_odd_count_is_a_value_error_naming_it(tmp_path):
    path = _file(tmp_path, {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(ValueError, match="tensor 'a' of F4 has shape \\[3\\]"):
        ckpt.load(path)


@pytest.mark.parametrize("offsets", [[0, 4, 8], [4]], ids=["three", "one"])
def test_data_offsets_not_a_pair_is_a_value_error_naming_the_tensor(tmp_path, offsets):
    """(the unpacking's own "too many values to unpack" escaped once the dtype check moved out of the try)"""
    path = _file(tmp_path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}, bytes(8))
    with pytest.raises(ValueError, match="tensor 'a' has a malformed or unsupported header entry"):
        ckpt.load(path)
