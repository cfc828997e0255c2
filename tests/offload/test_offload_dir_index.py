"""The index of an offload_dir (swapio-weights.json) is a file from outside like a checkpoint:
every defect is a ValueError naming it, raised before anything is attached, the model and the directory untouched."""
import json
import os

import pytest

from swapio.offload import disk_offload, remove_offload
from swapio.offload.api import _offloaded
from helpers.offload import assert_same_outputs, meta_model, resident_model

TENSOR = "transformer.h.0.attn.c_attn.weight"


def set_field(*keys, value, tensor=TENSOR):
    def mutate(index):
        target = index["tensors"][tensor] if tensor else index
        for key in keys[:-1]:
            target = target[key]
        if value is KeyError:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return mutate


DEFECTS = {
    "dtype-unknown": (set_field("dtype", value="float99"), "'dtype' must name a torch dtype"),
    "dtype-not-a-dtype": (set_field("dtype", value="nn"), "'dtype' must name a torch dtype"),
    "dtype-int": (set_field("dtype", value=5), "'dtype' must name a torch dtype"),
    "names-missing": (set_field("names", value=KeyError), "'names' must be a non-empty list"),
    "names-string": (set_field("names", value=TENSOR), "'names' must be a non-empty list"),
    "offset-string": (set_field("offset", value="0"), "'offset' must be a non-negative int"),
    "offset-float": (set_field("offset", value=0.0), "'offset' must be a non-negative int"),
    "nbytes-negative": (set_field("nbytes", value=-4096), "'nbytes' must be a non-negative int"),
    "nbytes-wrong": (set_field("nbytes", value=4), "'nbytes' is 4 but shape"),
    "shape-strings": (set_field("shape", value=["64", "192"]), "'shape' must be a list of non-negative ints"),
    "entry-list": (set_field(value=[1], tensor=None, *("tensors", TENSOR)), "the entry must be an object"),
    "tensors-list": (set_field("tensors", value=[], tensor=None), "'tensors' must be an object"),
    "data-escapes": (set_field("data", value="../swapio-weights-x.bin", tensor=None), "'data' must name"),
    "data-missing": (set_field("data", value=KeyError, tensor=None), "'data' must name"),
    "version-string": (set_field("version", value="1", tensor=None), "version must be a positive int"),
    # two tensors read from the same bytes (swapio never writes that: a tie is one entry with two names)
    "offsets-overlap": (set_field("offset", value=4096), "overlap"),
}


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("od") / "od"
    remove_offload(disk_offload(resident_model(), directory))
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DEFECTS))
def test_a_defective_index_is_a_value_error_before_anything_is_attached(offload_dir, name):
    mutate, message = DEFECTS[name]
    index_path = offload_dir / "swapio-weights.json"
    good = index_path.read_text()
    index = json.loads(good)
    mutate(index)
    index_path.write_text(json.dumps(index))
    before = sorted(os.listdir(offload_dir))
    model = meta_model()
    try:
        with pytest.raises(ValueError, match=message) as info:
            disk_offload(model, offload_dir)
        assert str(index_path) in str(info.value)
        assert model not in _offloaded and all(m.__dict__.get("forward") is None for m in model.modules())
        assert all(p.device.type == "meta" for p in model.parameters())
        assert sorted(os.listdir(offload_dir)) == before  # nothing removed, nothing left
    finally:
        index_path.write_text(good)
    model = disk_offload(model, offload_dir)  # the same model, once the index is right again
    assert_same_outputs(model)
    remove_offload(model)


@pytest.mark.slow
def test_data_file_holds_the_weights_and_zeros_between_them_across_reused_windows(tmp_path, monkeypatch):
    """offload_dir's data file goes through the library's streaming writer, whose two pinned windows are reused:
    each tensor's bytes land where the index says, and the padding between tensors and records is zeros, never
    bytes of an earlier window (read back from the file, independently of swapio's reader)."""
    import torch
    from swapio.offload import offload_dir
    monkeypatch.setattr(offload_dir, "CHUNK", 1 << 20)  # 1 MiB windows: the ~14 MiB file reuses each many times
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(300, 301) for _ in range(40)])
    for p in model.parameters():
        p.data.add_(3.0)  # no zero bytes in any weight: a stale byte in the padding cannot pass for one
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    disk_offload(model, offload_dir=str(tmp_path))
    try:
        with open(tmp_path / "swapio-weights.json") as f:
            index = json.load(f)
        data = (tmp_path / index["data"]).read_bytes()
        assert len(data) == index["data_bytes"] > 8 << 20
        covered = bytearray(len(data))
        for entry in index["tensors"].values():
            start, end = entry["offset"], entry["offset"] + entry["nbytes"]
            stored = torch.frombuffer(bytearray(data[start:end]), dtype=torch.float32).view(entry["shape"])
            for name in entry["names"]:
                assert torch.equal(stored, expected[name]), name
            covered[start:end] = b"\x01" * (end - start)
        padding = bytes(b for b, c in zip(data, covered) if not c)
        assert padding and padding.count(0) == len(padding)
    finally:
        remove_offload(model)
