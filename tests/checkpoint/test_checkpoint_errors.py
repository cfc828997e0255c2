"""Bad input to swapio.checkpoint: missing and read-only directories, a full disk, truncated and tampered files.
Each fails with an error naming the file (and the tensor), leaves the previous checkpoint intact and no temporary
file behind, and a failed load leaves out= unchanged."""
import errno
import json
import os
import struct

import pytest
import torch

import swapio
from helpers.checkpoint import assert_same, leftovers

MiB = 1 << 20


def test_missing_directory_is_enoent_naming_the_path(tmp_path):
    path = tmp_path / "nope" / "c.safetensors"
    for save in (swapio.checkpoint.save, swapio.checkpoint.async_save):
        with pytest.raises(OSError) as info:
            save({"a": torch.ones(3)}, path)
        assert info.value.errno == errno.ENOENT
        assert info.value.filename == str(path)
    assert not (tmp_path / "nope").exists()


def test_read_only_directory_is_erofs_and_keeps_what_is_there(readonly_dir):
    before = (readonly_dir / "existing.bin").read_bytes()
    with pytest.raises(OSError) as info:
        swapio.checkpoint.save({"a": torch.ones(3)}, readonly_dir / "existing.bin")
    assert info.value.errno in (errno.EROFS, errno.EACCES)
    assert info.value.filename == str(readonly_dir / "existing.bin")
    assert (readonly_dir / "existing.bin").read_bytes() == before


def test_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(OSError) as info:
        swapio.checkpoint.save({"a": torch.ones(3)}, tmp_path)
    assert info.value.errno == errno.EISDIR


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_full_disk_fails_with_enospc_and_keeps_the_previous_checkpoint(small_ext4_dir, asynchronous):
    path = small_ext4_dir / "c.safetensors"
    previous = {"w": torch.randn(1000), "step": 1}
    swapio.checkpoint.save(previous, path)
    before = path.read_bytes()
    big = {"w": torch.randn(16 * MiB), "step": 2}  # 64 MiB on a 48 MiB file system
    with pytest.raises(OSError) as info:
        if asynchronous:
            swapio.checkpoint.async_save(big, path, staging_bytes=8 * MiB).wait(timeout=60)
        else:
            swapio.checkpoint.save(big, path, staging_bytes=8 * MiB)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(path)
    assert path.read_bytes() == before
    assert_same(swapio.checkpoint.load(path), previous)
    assert leftovers(small_ext4_dir) == []
    swapio.checkpoint.save({"w": torch.randn(10)}, path)  # the space came back


def _saved(tmp_path):
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save({"model": {"a": torch.randn(3000), "b": torch.arange(500)}, "step": 7}, path)
    return path


def test_truncated_file_is_a_value_error_naming_file_and_tensor(tmp_path):
    path = _saved(tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    a, b = torch.zeros(3000), torch.zeros(500, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"c\.safetensors.*'model\.a'.*truncated"):
        swapio.checkpoint.load(path, out={"model": {"a": a, "b": b}})
    assert not a.any() and not b.any()  # out= untouched
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(ValueError, match="c.safetensors"):
        swapio.checkpoint.load(path)


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


def _structure(step='{"V": 7}', a='{"T": "model.a"}'):
    """The saved file's structure (model.a, model.b, step) with `step` or `a` replaced by a damaged node."""
    return '{"D": [["model", {"D": [["a", %s], ["b", {"T": "model.b"}]]}], ["step", %s]]}' % (a, step)


# Structure nodes flatten never writes (each a TypeError from deep inside the loader before they were checked)
_BAD_STRUCTURES = {
    "key-a-list": (_structure(step='{"D": [[["k"], {"V": 1}]]}'), "structure.*malformed.*dict key"),
    "key-a-dict": (_structure(step='{"D": [[{"k": 1}, {"V": 1}]]}'), "structure.*malformed.*dict key"),
    "items-a-dict": (_structure(step='{"D": {"k": {"V": 1}}}'), "structure.*malformed.*'D' must be a list"),
    "item-not-a-pair": (_structure(step='{"D": [["k"]]}'), "structure.*malformed.*'D' must be a list"),
    "list-a-dict": (_structure(step='{"L": {"k": 1}}'), "structure.*malformed.*'L' and 'U' must be lists"),
    "value-a-list": (_structure(step='{"V": [1, 2]}'), "structure.*malformed"),
    "stride-an-int": (_structure(a='{"T": "model.a", "stride": 5}'), r"'model\.a' has malformed strides"),
    "stride-null": (_structure(a='{"T": "model.a", "stride": null}'), r"'model\.a' has malformed strides"),
    # strides save never writes (it writes a dense permutation only): taken before, even with out= given
    "stride-gaps": (_structure(a='{"T": "model.a", "stride": [2]}'), r"'model\.a' has malformed strides"),
    "stride-overlap": (_structure(a='{"T": "model.a", "stride": [0]}'), r"'model\.a' has malformed strides"),
    "stride-huge": (_structure(a='{"T": "model.a", "stride": [4611686018427387904]}'),
                    r"'model\.a' has malformed strides"),
}


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["model.a"].update(shape=[3001]), r"'model\.a'.*\[3001\]"),
    (lambda h: h["model.b"].update(data_offsets=[12000, 16008]), r"'model\.b'.*(truncated|spans)"),
    (lambda h: h["model.a"].update(dtype="X99"), r"'model\.a'.*unsupported"),
    (lambda h: h.update({"model.c": h.pop("model.b")}), r"structure names tensor 'model\.b'"),
    (lambda h: h.pop("model.b"), r"leaves bytes \[0, 4000\) unused"),  # the entries must tile the data
    (lambda h: h["__metadata__"].update(structure='{"D": [["a", {"Q": 1}]]}'), "structure.*malformed"),
    (lambda h: h["__metadata__"].update(structure="{not json"), "structure.*malformed"),
    *[(lambda h, text=text: h["__metadata__"].update(structure=text), match)
      for text, match in _BAD_STRUCTURES.values()],
], ids=["shape", "offsets", "dtype", "missing-tensor", "dropped-entry", "bad-node", "bad-json", *_BAD_STRUCTURES])
def test_tampered_header_is_a_value_error_and_out_is_unchanged(tmp_path, edit, match):
    path = _saved(tmp_path)
    _rewrite_header(path, edit)
    a, b = torch.zeros(3000), torch.zeros(500, dtype=torch.int64)
    with pytest.raises(ValueError, match=match) as info:
        swapio.checkpoint.load(path, out={"model": {"a": a, "b": b}})
    assert "c.safetensors" in str(info.value)
    assert not a.any() and not b.any()


def test_a_failed_save_leaves_no_file_and_the_old_one(tmp_path, monkeypatch):
    """An error in the middle of the writes (here: the second pwrite, the header's, after the big tensor's own
    request was submitted) removes the temporary file."""
    path = tmp_path / "c.safetensors"
    old = {"x": torch.ones(10)}
    swapio.checkpoint.save(old, path)
    calls = []
    real = swapio.AioHandle.pwrite

    def failing(self, tensor, p, offset=0, **kw):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected", p)
        return real(self, tensor, p, offset, **kw)

    monkeypatch.setattr(swapio.AioHandle, "pwrite", failing)
    with pytest.raises(OSError) as info:
        swapio.checkpoint.save({"x": torch.randn(3 * MiB)}, path, staging_bytes=2 * MiB)
    assert info.value.errno == errno.EIO and len(calls) == 2
    monkeypatch.undo()
    assert_same(swapio.checkpoint.load(path), old)
    assert leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_a_header_over_the_safetensors_limit_is_refused_before_any_file(tmp_path, asynchronous):
    """A header (JSON incl. __metadata__) over 100 MiB would make a file no reader (ours included) accepts."""
    path = tmp_path / "c.safetensors"
    fn = swapio.checkpoint.async_save if asynchronous else swapio.checkpoint.save
    with pytest.raises(ValueError, match="104857600 bytes"):
        fn({"note": "x" * (101 * MiB), "t": torch.ones(3)}, path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("make, match", [
    (lambda: {"a": torch.zeros(3000), "b": torch.zeros(1, dtype=torch.int64).expand(500)}, r"'model\.b'.*sharing"),
    (lambda: (lambda big: {"a": big[:3000], "b": big[1000:2000].view(torch.int64)})(torch.zeros(4000)),
     r"'model\.a' and 'model\.b' share memory"),
], ids=["expanded", "aliased"])
def test_out_tensors_sharing_memory_are_refused_before_any_byte_is_written(tmp_path, make, match):
    path = _saved(tmp_path)
    inner = make()
    with pytest.raises(ValueError, match=match) as info:
        swapio.checkpoint.load(path, out={"model": inner})
    assert "c.safetensors" in str(info.value)
    assert not inner["a"].any() and not inner["b"].any()  # out= unchanged


def _nested(depth):
    state = leaf = {}
    for _ in range(depth - 1):
        leaf["a"] = {}
        leaf = leaf["a"]
    leaf["t"] = torch.ones(2)
    return state


def test_a_cyclic_or_too_deep_state_is_a_type_error_and_100_levels_save(tmp_path):
    path = tmp_path / "c.safetensors"
    cyclic = {"x": [1]}
    cyclic["x"].append(cyclic)
    with pytest.raises(TypeError, match=r"state\['x'\]\[1\].*cycle"):
        swapio.checkpoint.save(cyclic, path)
    with pytest.raises(TypeError, match="deeper than 100"):
        swapio.checkpoint.save(_nested(3000), path)
    with pytest.raises(TypeError, match="deeper than 100"):
        swapio.checkpoint.save(_nested(101), path)
    assert os.listdir(tmp_path) == []
    shared = [1, 2]
    swapio.checkpoint.save({"a": shared, "b": shared, "deep": _nested(99)}, path)  # shared is no cycle
    assert_same(swapio.checkpoint.load(path), {"a": [1, 2], "b": [1, 2], "deep": _nested(99)})


def test_a_deeply_nested_structure_in_the_file_is_a_value_error_naming_it(tmp_path):
    path = _saved(tmp_path)
    deep = json.dumps({"__metadata__": {"format": "swapio.checkpoint", "format_version": "1",
                                        "structure": "[" * 100000 + "]" * 100000}}).encode()
    path.write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(ValueError, match=r"c\.safetensors.*structure.*deeper"):
        swapio.checkpoint.load(path)


def test_a_sharded_index_with_an_empty_weight_map_is_a_value_error_naming_it(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*empty"):
        swapio.checkpoint.load(tmp_path)


def test_a_missing_file_is_file_not_found_and_a_fifo_a_value_error_without_blocking(tmp_path):
    for missing in (tmp_path / "nothing.safetensors", tmp_path / "no" / "dir.safetensors"):
        with pytest.raises(FileNotFoundError) as info:
            swapio.checkpoint.load(missing)
        assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
    os.symlink(tmp_path / "gone", tmp_path / "link.safetensors")
    with pytest.raises(FileNotFoundError):
        swapio.checkpoint.load(tmp_path / "link.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")  # never opened: opening a FIFO blocks until a writer comes
    with pytest.raises(ValueError, match="fifo.safetensors.*not a file"):
        swapio.checkpoint.load(tmp_path / "fifo.safetensors")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_loading_onto_cuda_without_cuda_is_a_runtime_error_saying_so(tmp_path, device):
    path = _saved(tmp_path)
    with pytest.raises(RuntimeError, match="needs CUDA, but"):
        swapio.checkpoint.load(path, device=device)


def test_a_nested_tensor_is_a_type_error_naming_its_key(tmp_path):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match=r"state\['m'\]\['n'\]: a nested tensor"):
        swapio.checkpoint.save({"m": {"n": nested}}, tmp_path / "c.safetensors")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("stride", [[1, 1], [0, 0], [2**40, 1], [2**62, 2**62], [3, 1]],
                         ids=["overlapping", "zero", "huge", "overflowing", "gaps"])
def test_tampered_strides_are_a_value_error_not_a_huge_allocation_or_overlapping_values(tmp_path, stride):
    """A transposed tensor comes back with the strides the structure records; strides that do not cover its
    shape densely (which save never writes) were handed to empty_strided: a terabyte allocation, torch's
    overflow error, or (overlapping) a tensor whose elements alias each other, loaded without a word."""
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save({"a": torch.arange(6.).reshape(2, 3).t()}, path)
    assert swapio.checkpoint.load(path)["a"].stride() == (1, 3)
    _rewrite_header(path, lambda h: h["__metadata__"].update(
        structure=json.dumps({"D": [["a", {"T": "a", "stride": stride}]]})))
    with pytest.raises(ValueError, match=r"c\.safetensors.*'a' has malformed strides"):
        swapio.checkpoint.load(path)


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "quint4x2", "quint2x4"])
def test_a_structure_naming_a_quantized_dtype_is_a_value_error_not_a_crash(tmp_path, dtype):
    """Raw-stored tensors (complex128 here) record their dtype in the structure; a tampered one naming a quantized
    dtype (which save refuses) made load build a quantized tensor and view its bytes: a segmentation fault."""
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save({"a": torch.zeros(6, dtype=torch.complex128)}, path)

    def edit(h):
        itemsize = getattr(torch, dtype).itemsize
        h["a"]["shape"] = [96 // itemsize, itemsize]
        h["__metadata__"]["structure"] = json.dumps({"D": [["a", {"T": "a", "dtype": dtype}]]})
    _rewrite_header(path, edit)
    with pytest.raises(ValueError, match=rf"c\.safetensors.*'a'.*{dtype}"):
        swapio.checkpoint.load(path)


def test_a_shape_whose_storage_size_overflows_is_a_value_error_naming_file_and_tensor(tmp_path):
    path = tmp_path / "c.safetensors"
    h = json.dumps({"a": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h)
    with pytest.raises(ValueError, match=r"c\.safetensors.*'a'.*overflows"):
        swapio.checkpoint.load(path)


@pytest.mark.parametrize("staging, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                            (None, TypeError), (True, TypeError)])
@pytest.mark.parametrize("call", ["save", "async_save", "load", "load_file"])
def test_staging_bytes_must_be_a_positive_int(tmp_path, call, staging, error):
    # (offload.load_file took any: 0, -1, 1.5 and True silently, "x" or None with an opaque TypeError)
    with pytest.raises(error, match="staging_bytes must be a positive int"):
        _refused_call(tmp_path, call, staging_bytes=staging)


def _refused_call(tmp_path, call, **kwargs):
    """`call` (a save or a load of tmp_path/c.safetensors) with kwargs, which must raise; then nothing more than
    the file loaded is in the directory (a save wrote nothing)."""
    path = tmp_path / "c.safetensors"
    reads = call.startswith("load")
    if reads:
        swapio.checkpoint.save({"t": torch.ones(3)}, path)
    try:
        if call == "load":
            swapio.checkpoint.load(path, **kwargs)
        elif call == "load_file":
            swapio.offload.load_file(path, **kwargs)
        else:
            getattr(swapio.checkpoint, call)({"t": torch.ones(3)}, path, **kwargs)
    finally:
        assert os.listdir(tmp_path) == (["c.safetensors"] if reads else [])


@pytest.mark.parametrize("call", ["save", "async_save", "load", "load_file"])
def test_a_handle_that_is_not_an_aiohandle_is_a_type_error(tmp_path, call):
    # (an AttributeError: 'int' object has no attribute 'pwrite')
    with pytest.raises(TypeError, match="^handle must be a swapio.AioHandle, got int"):
        _refused_call(tmp_path, call, handle=3)


@pytest.mark.parametrize("call", ["save", "async_save", "save_checkpoint"])
def test_a_tensor_released_by_swap_out_is_a_value_error_before_any_write(tmp_path, call):
    # (save and save_checkpoint: torch's "setStorage: ... out of bounds for storage of size 0" while the file was
    # written; async_save's capture said so already)
    model = torch.nn.Linear(4, 4)
    with swapio.SwapStore(tmp_path / "swap") as store:
        store.swap_out(model.weight.data).wait()
        with pytest.raises(ValueError, match="released by SwapStore.swap_out"):
            if call == "save_checkpoint":
                swapio.offload.save_checkpoint(model, tmp_path / "out")
            else:
                getattr(swapio.checkpoint, call)(model.state_dict(), tmp_path / "c.safetensors")
    assert os.listdir(tmp_path) == []


def test_sizes_take_numpy_integers_and_a_huge_staging_allocates_what_the_file_needs(tmp_path):
    # numpy ints were refused ("got int64"; max_shard_size: "must be a positive number of bytes ... got
    # np.int64(1000)"), as swapio's other sizes take them; load_file allocated two windows of half the
    # staging_bytes given whatever the file's size (2**62: an OSError, out of memory)
    np = pytest.importorskip("numpy")
    state = {"t": torch.arange(5.0)}
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save(state, path, staging_bytes=np.int64(1 << 20))
    swapio.checkpoint.async_save(state, path, staging_bytes=np.int32(1 << 20)).wait(timeout=60)
    assert torch.equal(swapio.checkpoint.load(path, staging_bytes=np.uint64(1 << 20))["t"], state["t"])
    for staging in (np.int64(1 << 20), 2**62):
        assert torch.equal(swapio.offload.load_file(path, staging_bytes=staging)["t"], state["t"])
    model = torch.nn.Linear(4, 3)
    index = swapio.offload.save_checkpoint(model, tmp_path / "sharded", max_shard_size=np.int64(64))
    assert len(json.loads(open(index).read())["weight_map"]) == 2
    loaded = swapio.offload.load_file(tmp_path / "sharded")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("key", ["format", "format_version", "structure"])
@pytest.mark.parametrize("call", ["save", "async_save"])
def test_reserved_metadata_keys_are_a_value_error_naming_the_key(tmp_path, call, key):
    with pytest.raises(ValueError, match=f"metadata key '{key}' is reserved"):
        getattr(swapio.checkpoint, call)({"t": torch.ones(3)}, tmp_path / "c.safetensors", metadata={key: "x"})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("metadata", ["k=v", [("k", "v")], 3, {"k": 1}], ids=repr)
@pytest.mark.parametrize("call", ["save", "async_save"])
def test_metadata_that_is_not_a_dict_of_str_is_a_type_error_naming_it(tmp_path, call, metadata):
    # (a str raised dict()'s ValueError "dictionary update sequence element #0 has length 1", an int
    # "'int' object is not iterable", and a list of pairs was taken, which safetensors' save_file refuses)
    with pytest.raises(TypeError, match="metadata must be a dict of str to str"):
        getattr(swapio.checkpoint, call)({"t": torch.ones(3)}, tmp_path / "c.safetensors", metadata=metadata)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("distributed", ["False", 0, None], ids=repr)
def test_distributed_must_be_a_bool(tmp_path, distributed):
    # ("False" asked for a distributed save: a directory of rank files where a process group exists)
    with pytest.raises(TypeError, match="^distributed must be True or False"):
        swapio.checkpoint.save({"t": torch.ones(3)}, tmp_path / "c.safetensors", distributed=distributed)
    assert os.listdir(tmp_path) == []


def _rank_0_of_1(save_id):
    """The __metadata__ a distributed save of one rank writes into its file."""
    from swapio.checkpoint import sharded
    return {sharded.META_SAVE_ID: save_id, sharded.META_RANK: "0", sharded.META_WORLD: "1"}


@pytest.mark.parametrize("index, match", [
    (b"[" * 100000 + b"]" * 100000, "nests deeper"),
    (b'{"format": "swapio.checkpoint.sharded", "world_size": 1.7, "save_id": "s"}', "not a swapio sharded"),
    (b'{"format": "swapio.checkpoint.sharded", "world_size": true, "save_id": "s"}', "not a swapio sharded"),
    (b'{"format": "swapio.checkpoint.sharded", "world_size": 1, "world_size": 2, "save_id": "s"}', "twice"),
    (b"\xff\xfe{}", "not UTF-8"),
], ids=["deeply-nested", "world-size-float", "world-size-bool", "duplicate-key", "utf16"])
def test_a_defective_sharded_index_is_a_value_error_naming_it(tmp_path, index, match):
    """The index of a save(distributed=True) comes from outside like its files: a deeply nested one raised
    RecursionError from json, and a world size of 1.7 read as 1."""
    from swapio.checkpoint import sharded
    swapio.checkpoint.save({"a": torch.ones(3)}, tmp_path / "rank-0.safetensors", metadata=_rank_0_of_1("s"))
    (tmp_path / sharded.INDEX).write_bytes(b'{"format": "swapio.checkpoint.sharded", "world_size": 1, "save_id": "s"}')
    assert torch.equal(swapio.checkpoint.load(tmp_path)["a"], torch.ones(3))  # a valid index loads
    (tmp_path / sharded.INDEX).write_bytes(index)
    with pytest.raises(ValueError, match=match) as info:
        swapio.checkpoint.load(tmp_path)
    assert sharded.INDEX in str(info.value)


_SAVE_ID = "0123456789abcdef"
_V2 = {"format": "swapio.checkpoint.sharded", "format_version": 2, "world_size": 1, "save_id": _SAVE_ID,
       "files": [f"rank-0-{_SAVE_ID}.safetensors"]}


@pytest.mark.parametrize("change, match", [
    ({"files": ["../outside.safetensors"]}, "names the files.*refused"),
    ({"files": ["/tmp/outside.safetensors"]}, "names the files.*refused"),
    ({"files": ["rank-0.safetensors"]}, "names the files.*refused"),  # version 1's name in a version 2 index
    ({"files": [f"rank-1-{_SAVE_ID}.safetensors"]}, "names the files.*refused"),  # another rank's
    ({"files": f"rank-0-{_SAVE_ID}.safetensors"}, "names the files.*refused"),
    ({"files": None}, "names the files.*refused"),
    ({"files": [f"rank-0-{_SAVE_ID}.safetensors"] * 2}, "names the files.*refused"),
    ({"save_id": "../../x"}, "malformed save_id"),
    ({"save_id": 7}, "malformed save_id"),
    ({"format_version": 3}, "format version 3; this swapio reads versions 1 to 2"),
    ({"format_version": "2"}, "not a swapio sharded"),
    ({"world_size": 0}, "not a swapio sharded"),
    ({"format_version": None, "save_id": "s", "files": ["../outside.safetensors"]}, "names the files.*refused"),
    # a world size the index claims was turned into a list of that many names first (10**9: MemoryError, or swap)
    ({"world_size": 10 ** 9}, "names the files.*refused"),
    ({"format_version": None, "save_id": "s", "files": None, "world_size": 10 ** 9},
     "saved by 1000000000 ranks and this job has 1"),
    ({"world_size": 10 ** 4000}, r"a world size of 10{29} ranks: not a swapio sharded"),
    ({"pad": "x" * (17 << 20)}, "larger than 16 MiB: not a swapio sharded checkpoint index"),
], ids=["parent", "absolute", "version-1-name", "other-rank", "not-a-list", "missing", "too-many", "save-id-path",
        "save-id-int", "newer-version", "version-str", "world-0", "version-1-parent", "world-1e9",
        "version-1-world-1e9", "world-huge-int", "index-over-16-MiB"])
def test_a_sharded_index_naming_other_files_than_a_save_writes_is_refused(tmp_path, change, match):
    """The index comes from outside: a name it gives must be exactly the one a save writes for that rank (in the
    directory), whatever else the directory or its parent holds."""
    from swapio.checkpoint import sharded
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for file, save_id in ((directory / _V2["files"][0], _SAVE_ID), (tmp_path / "outside.safetensors", "s"),
                          (directory / "rank-0.safetensors", _SAVE_ID)):
        swapio.checkpoint.save({"a": torch.ones(3)}, file, metadata=_rank_0_of_1(save_id))
    (directory / sharded.INDEX).write_text(json.dumps(_V2))
    assert torch.equal(swapio.checkpoint.load(directory)["a"], torch.ones(3))  # the valid index loads
    index = {k: v for k, v in {**_V2, **change}.items() if v is not None}
    (directory / sharded.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=match) as info:
        swapio.checkpoint.load(directory)
    assert sharded.INDEX in str(info.value)


@pytest.mark.parametrize("make, error, match", [
    # opened without blocking: a FIFO waits for a writer
    (os.mkfifo, ValueError, "is a FIFO, not a swapio sharded checkpoint index"),
    (os.mkdir, ValueError, "is a directory, not a swapio sharded checkpoint index"),
    (lambda p: os.symlink(str(p) + ".gone", p), FileNotFoundError, "No such file"),
], ids=["fifo", "directory", "dangling-link"])
def test_a_sharded_index_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, make, error, match):
    """Before: the directory was taken for a save_pretrained one ("has neither model.safetensors nor ...")."""
    from swapio.checkpoint import sharded
    directory = tmp_path / "ckpt"
    directory.mkdir()
    swapio.checkpoint.save({"a": torch.ones(3)}, directory / _V2["files"][0],
                           metadata=_rank_0_of_1(_SAVE_ID))
    make(directory / sharded.INDEX)
    with pytest.raises(error, match=match) as info:
        swapio.checkpoint.load(directory)
    assert sharded.INDEX in str(info.value)


@pytest.mark.parametrize("make, match", [
    (os.mkfifo, "which is not a regular file"),
    (os.mkdir, "which is not a regular file"),
    (lambda p: None, "which does not exist"),
], ids=["fifo", "directory", "missing"])
def test_a_sharded_rank_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, make, match):
    from swapio.checkpoint import sharded
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / sharded.INDEX).write_text(json.dumps(_V2))
    make(directory / _V2["files"][0])
    with pytest.raises(ValueError, match=f"{sharded.INDEX} names .*{_V2['files'][0]}, {match}"):
        swapio.checkpoint.load(directory)


def test_a_sharded_rank_file_linking_outside_its_directory_is_refused(tmp_path):
    from swapio.checkpoint import sharded
    directory = tmp_path / "ckpt"
    directory.mkdir()
    swapio.checkpoint.save({"a": torch.ones(3)}, tmp_path / "outside.safetensors",
                           metadata=_rank_0_of_1(_SAVE_ID))
    os.symlink(tmp_path / "outside.safetensors", directory / _V2["files"][0])
    (directory / sharded.INDEX).write_text(json.dumps(_V2))
    with pytest.raises(ValueError, match="is a link to .*outside the checkpoint directory"):
        swapio.checkpoint.load(directory)


@pytest.mark.parametrize("call", ["save", "async_save"])
def test_a_tensor_name_or_metadata_utf8_cannot_hold_is_a_value_error_before_any_file(tmp_path, call):
    """A name with a lone surrogate (os.listdir gives them for file names that are not UTF-8) was written as a JSON
    escape that the safetensors library refuses ("unexpected end of hex escape"): a file other readers cannot
    open, though the format's promise is that they can. Other non-ASCII names are fine."""
    st = pytest.importorskip("safetensors.torch")
    save = getattr(swapio.checkpoint, call)
    path = tmp_path / "c.safetensors"
    done = save({"files": {"caf\u00e9-\U0001F600": torch.ones(2)}}, path)
    if call == "async_save":
        done.wait()
    assert torch.equal(st.load_file(str(path))["files.caf\u00e9-\U0001F600"], torch.ones(2))
    os.remove(path)
    for state, metadata, match in [({"files": {"x\udcff": torch.ones(2)}}, None, r"tensor name 'files\.x\\udcff'"),
                                   ({"a": torch.ones(2)}, {"k": "\ud800"}, r"metadata value '\\ud800'"),
                                   ({"a": torch.ones(2)}, {"\ud800": "v"}, r"metadata key '\\ud800'")]:
        with pytest.raises(ValueError, match=match + ".*not valid Unicode"):
            save(state, path, metadata=metadata)
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["metadata-value", "metadata-key"])
def test_a_lone_surrogate_escape_in_the_header_is_a_value_error_as_in_safetensors(tmp_path, where):
    """json.dumps escapes a lone surrogate as \\ud800; Python's json reads it back, the safetensors library refuses."""
    path = _saved(tmp_path)
    if where == "metadata-value":
        _rewrite_header(path, lambda h: h["__metadata__"].update(note="x\ud800"))
    else:
        _rewrite_header(path, lambda h: h["__metadata__"].update({"\udc00": "x"}))
    assert b"\\ud" in path.read_bytes()[:4096]
    safetensors = pytest.importorskip("safetensors")
    with pytest.raises(Exception):  # the reference: its Rust parser refuses the header
        safetensors.safe_open(str(path), "pt")
    a, b = torch.zeros(3000), torch.zeros(500, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"c\.safetensors.*lone surrogate"):
        swapio.checkpoint.load(path, out={"model": {"a": a, "b": b}})
    assert not a.any() and not b.any()
