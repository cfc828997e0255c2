"""Checkpoints from outside are hostile: a malformed header, a shard outside its
directory, or a file that shrinks under the reader is a ValueError or an OSError naming the file, never garbage,
a huge allocation or another exception type. The safetensors library is the reference for what is malformed."""
import errno
import json
import os
import struct

import pytest
import torch

import swapio
from swapio.offload import disk_offload, load_file, remove_offload
from swapio.offload import api as offload_api
from swapio.safetensors import reader as load_module
from swapio.offload.api import _offloaded

safetensors_torch = pytest.importorskip("safetensors.torch")


def raw_file(path, header, data=b""):
    """A .safetensors file with this header (a dict, or the exact header bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def rejected_by_safetensors(path):
    with pytest.raises(Exception):  # the library's own error type (SafetensorError): it refuses the file too
        safetensors_torch.load_file(str(path))


def entry(shape, begin, end, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


MALFORMED = {
    # accepted before, refused by the safetensors library
    "overlapping": ({"a": entry([4], 0, 16), "b": entry([4], 8, 24)}, 24, r"starts at data byte 8, which overlaps"),
    "same-bytes": ({"a": entry([4], 0, 16), "b": entry([4], 0, 16)}, 16, "overlaps"),
    "gap": ({"a": entry([2], 0, 8), "b": entry([2], 16, 24)}, 24, r"leaves bytes \[8, 16\) unused"),
    "trailing-data": ({"a": entry([2], 0, 8)}, 16, "the tensors end at data byte 8 but the file holds 16"),
    "duplicate-key": (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                      b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', 8, "has the key 'a' twice"),
    "shape-strings": ({"a": entry(["2"], 0, 8)}, 8, "malformed"),
    "shape-floats": ({"a": entry([2.0], 0, 8)}, 8, "malformed"),
    "offsets-floats": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, 8, "malformed"),
    "shape-bool": ({"a": entry([True], 0, 4)}, 4, "malformed"),
    "utf16": (json.dumps({"a": entry([1], 0, 4)}).encode("utf-16"), 4, "not UTF-8"),
    "metadata-not-strings": ({"__metadata__": {"k": 1}, "a": entry([1], 0, 4)}, 4, "__metadata__"),
    # other exception types before
    "infinity": (b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', 4, "Infinity"),
    "nan": (b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', 4, "NaN"),
    "huge-dimension": ({"a": entry([2**64, 0], 0, 0)}, 0, "malformed"),
    "negative-dimension": ({"a": entry([-1], 0, 0)}, 0, "malformed"),
    "deeply-nested": (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", 0, "nests deeper"),
    "entry-not-object": ({"a": [1, 2]}, 0, "malformed"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_header_is_a_value_error_naming_the_file(tmp_path, name):
    header, nbytes, message = MALFORMED[name]
    path = raw_file(tmp_path / f"{name}.safetensors", header, bytes(nbytes))
    rejected_by_safetensors(path)
    with pytest.raises(ValueError, match=message) as info:
        load_file(path)
    assert str(path) in str(info.value)


def test_overlapping_offsets_cannot_make_a_small_file_allocate_much(tmp_path):
    """64 tensors of 16 MiB all over the same 16 MiB: load_file allocated 1 GiB for this file before."""
    n = 4 << 20
    header = {f"t{i}": entry([n], 0, 4 * n) for i in range(64)}
    path = tmp_path / "overlap.safetensors"
    with open(path, "wb") as f:
        raw = json.dumps(header).encode()
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 4 * n)
    rejected_by_safetensors(path)
    with pytest.raises(ValueError, match="overlaps"):
        load_file(path)


@pytest.mark.parametrize("shape", [[0, 2**40, 2**40], [2**62, 2**62, 0]], ids=["strides", "storage"])
def test_a_zero_size_shape_whose_storage_size_overflows_is_a_value_error_naming_file_and_tensor(tmp_path, shape):
    """A zero-size tensor holds no bytes, but torch still computes its strides and storage size from every
    dimension: load_file raised torch's RuntimeError ("Stride calculation overflowed") where swapio.checkpoint.load
    gave a ValueError naming the file."""
    path = raw_file(tmp_path / "zero.safetensors", {"a": entry(shape, 0, 0)})
    for load in (load_file, swapio.checkpoint.load):
        with pytest.raises(ValueError, match=r"zero\.safetensors: tensor 'a' has shape .* overflows 64 bits"):
            load(path)


def test_a_valid_file_still_agrees_with_safetensors(tmp_path):
    tensors = {"w": torch.randn(5, 3), "e": torch.empty(0, 2), "i": torch.arange(6, dtype=torch.int64)}
    path = tmp_path / "ok.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    got = load_file(path)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)


# ---- a file that shrinks while it is read -----------------------------------------------------------------------
def shrink_after_header(monkeypatch, module, path, keep):
    real = module.open_checkpoint

    def shrinking(checkpoint):
        locations = real(checkpoint)
        os.truncate(path, keep)  # between reading the header and reading the data
        return locations
    monkeypatch.setattr(module, "open_checkpoint", shrinking)


def test_load_file_of_a_file_that_shrinks_is_enodata_not_garbage(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, str(path))
    shrink_after_header(monkeypatch, load_module, path, os.path.getsize(path) // 4)
    with pytest.raises(OSError) as info:
        load_file(path, staging_bytes=1 << 20)
    assert info.value.errno == errno.ENODATA and info.value.filename == str(path) and "offset" in str(info.value)


def linear_stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])


def meta_stack():
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])


def test_disk_offload_of_a_checkpoint_that_shrinks_is_an_oserror_not_garbage(tmp_path, monkeypatch):
    """A file shorter than its header says, written in place since it was parsed: an OSError naming it (ESTALE,
    test_offload_checkpoint_rewritten.py), from the read that ran past its end (ENODATA) or the check after it."""
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file(linear_stack().state_dict(), str(path))
    shrink_after_header(monkeypatch, offload_api, path, os.path.getsize(path) - 5000)
    model = disk_offload(meta_stack(), checkpoint=path, prefetch=0)
    with pytest.raises(OSError, match="written in place") as info, torch.no_grad():
        model(torch.randn(2, 256))
    assert info.value.errno == errno.ESTALE and info.value.filename == str(path)
    remove_offload_or_fail_cleanly(model)


def remove_offload_or_fail_cleanly(model):
    """remove_offload reads every weight: with the file short it raises the OSError and leaves the model
    offloaded as it was (not half resident, half meta)."""
    with pytest.raises(OSError) as info:
        remove_offload(model)
    assert info.value.errno == errno.ESTALE
    assert model in _offloaded and all(p.device.type == "meta" for p in model.parameters())


def test_a_checkpoint_truncated_after_offloading_is_an_oserror_in_forward(tmp_path):
    path = tmp_path / "w.safetensors"
    reference = linear_stack()
    safetensors_torch.save_file(reference.state_dict(), str(path))
    model = disk_offload(meta_stack(), checkpoint=path, prefetch=0)
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        os.truncate(path, os.path.getsize(path) - 5000)
        with pytest.raises(OSError, match="written in place") as info:
            model(x)
    assert info.value.errno == errno.ESTALE and info.value.filename == str(path)


# ---- shards confined to the checkpoint directory ---------------------------------------------------------------
def sharded(tmp_path, shard_names):
    """A two-tensor checkpoint: tensor 'a' in a shard at shard_names['a'] (relative to tmp_path/ck), 'b' in b."""
    ck = tmp_path / "ck"
    ck.mkdir(exist_ok=True)
    for name, where in shard_names.items():
        target = ck / where if not os.path.isabs(where) else where
        os.makedirs(os.path.dirname(target), exist_ok=True)
        safetensors_torch.save_file({name: torch.full((4,), float(ord(name)))}, str(target))
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard_names}))
    return ck


@pytest.mark.parametrize("where", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"],
                         ids=["dotdot", "nested-dotdot", "absolute"])
def test_a_shard_outside_the_directory_is_refused(tmp_path, where):
    if where == "ABS":
        where = str(tmp_path / "elsewhere" / "outside.safetensors")
    ck = sharded(tmp_path, {"a": where, "b": "b.safetensors"})
    with pytest.raises(ValueError, match=r"outside the checkpoint directory") as info:
        load_file(ck)
    assert "model.safetensors.index.json" in str(info.value)


def test_a_shard_linked_outside_the_directory_is_refused(tmp_path):
    outside = tmp_path / "secret.safetensors"
    safetensors_torch.save_file({"a": torch.ones(4)}, str(outside))
    ck = sharded(tmp_path, {"b": "b.safetensors"})
    os.symlink(outside, ck / "a.safetensors")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a.safetensors",
                                                                                "b": "b.safetensors"}}))
    with pytest.raises(ValueError, match=r"is a link to .*secret.safetensors, outside"):
        load_file(ck)
    with pytest.raises(ValueError, match="outside"):
        disk_offload(torch.nn.Module(), checkpoint=ck)


@pytest.mark.parametrize("shard", [7, None, ["a.safetensors"], ""], ids=["int", "null", "list", "empty"])
def test_a_shard_name_that_is_not_a_string_is_a_value_error(tmp_path, shard):
    ck = sharded(tmp_path, {"b": "b.safetensors"})
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "b.safetensors", "a": shard}}))
    with pytest.raises(ValueError, match="model.safetensors.index.json: a weight_map entry must be a shard file"):
        load_file(ck)


def test_links_inside_the_directory_and_a_hub_cache_snapshot_are_read(tmp_path):
    """The Hugging Face cache keeps a snapshot's files (index included) as links into ../../blobs: allowed."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name in "ab":
        safetensors_torch.save_file({name: torch.full((4,), float(ord(name)))}, str(blobs / f"{name}-blob"))
        os.symlink(f"../../blobs/{name}-blob", snap / f"{name}.safetensors")
    (blobs / "index-blob").write_text(json.dumps({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    os.symlink("../../blobs/index-blob", snap / "model.safetensors.index.json")
    got = load_file(snap)
    assert torch.equal(got["a"], torch.full((4,), 97.0)) and torch.equal(got["b"], torch.full((4,), 98.0))
    ck = sharded(tmp_path, {"a": "real/a.safetensors", "b": "b.safetensors"})  # a link within the directory
    os.symlink("real/a.safetensors", ck / "a-link.safetensors")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a-link.safetensors",
                                                                                "b": "b.safetensors"}}))
    assert torch.equal(load_file(ck)["a"], torch.full((4,), 97.0))
