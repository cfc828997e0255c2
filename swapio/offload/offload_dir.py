"""offload_dir: the model's weights written once, streamed, in a layout read back with single aligned requests.

Files: `swapio-weights-<token>.bin` holds the records one after the other, each starting at a 4 KiB boundary
with its tensors at 64-byte boundaries (so a record is one O_DIRECT read into a pinned region);
`swapio-weights.json` names that file and, per tensor, its names, offset, byte count, dtype and shape.
Writing never holds more than two staging windows beyond the model itself: the library's one streaming writer
(swapio.safetensors.writer) copies the tensors window by window into pinned buffers and writes one window while the
next fills. The space is reserved first (a full disk fails before a
byte is written), the data file is fsynced and renamed, then the index is written, fsynced and renamed over the
old one (the commit point). Any failure removes everything this call created: nothing partial is left.
"""
import errno
import json
import math
import os
import secrets

import torch

from .. import _progress
from ..core import _durable
from ..core._owned_fd import OwnedFd
from ..safetensors import writer
from ..safetensors.dtypes import dtype_name
from ..safetensors.header import MAX_HEADER, Location, strict_json

from .dir_owner import DATA_PREFIX, DATA_SUFFIX, INDEX, remove_leftovers
FORMAT, VERSION = "swapio.offload", 1
CHUNK = 64 << 20


def _reserve(path, nbytes):
    with OwnedFd.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644) as owned:
        try:
            os.posix_fallocate(owned.fileno(), 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise OSError(exc.errno, f"cannot reserve {nbytes} bytes for the offloaded weights: "
                                         f"{os.strerror(exc.errno)}", path) from None
            os.ftruncate(owned.fileno(), nbytes)


def write(directory, records, source_of, handle, chunk=None, claim=None, progress=False):
    """Writes every slot of `records` (packed layout) from source_of(slot), a tensor on any device, into
    `directory`, which the caller claimed (dir_owner.claim; `claim`: that claim, told which files a SIGTERM
    should remove). progress: swapio._progress's rule for a bar of the bytes written (None: on a terminal).
    Returns {slot: (path, offset, nbytes)}."""
    directory = os.path.abspath(os.fspath(directory))
    token = secrets.token_hex(8)
    data_name = f"{DATA_PREFIX}{token}{DATA_SUFFIX}"
    data_path = os.path.join(directory, data_name)
    tmp_data = os.path.join(directory, f".{data_name}.tmp")
    tmp_index = os.path.join(directory, f".{INDEX}.{token}.tmp")
    locations, pieces, entries, end = {}, [], {}, 0
    for record in records:
        for slot in record.slots:
            offset = end + record.offsets[slot]
            locations[slot] = (data_path, offset, slot.nbytes)
            entries[slot.name] = {"names": slot.names, "offset": offset, "nbytes": slot.nbytes,
                                  "dtype": dtype_name(slot.dtype), "shape": list(slot.shape)}
        end += record.nbytes
    temporary = (tmp_data, tmp_index)
    if claim is not None:
        claim.files.update(temporary)
    try:
        _reserve(tmp_data, end)
        for slot, (_, offset, _) in sorted(locations.items(), key=lambda kv: kv[1][1]):
            if slot.nbytes:
                pieces.append((offset, slot.nbytes,
                               lambda s=slot: source_of(s).detach().contiguous().reshape(-1).view(torch.uint8)))
        bar = _progress.bar(progress, total=end, unit="B", unit_scale=True, unit_divisor=1024,
                            desc="swapio: writing offloaded weights")
        chunk = chunk or CHUNK
        staging = writer.Staging(2 * chunk, end, window_bytes=chunk, keep=False)
        try:
            writer.write(handle, tmp_data, end, pieces, staging, bar=bar)
        finally:
            staging.release()  # a request still in flight after an interruption keeps its memory (its handle does)
            if bar is not None:
                bar.close()
        pieces.clear()
        index = {"format": FORMAT, "version": VERSION, "data": data_name, "data_bytes": end, "tensors": entries}
        if claim is not None and claim.source is not None:
            index["source"] = claim.source  # the checkpoint these weights derive from (source.py)
        _durable.commit_data_and_index(tmp_data, data_path, tmp_index, os.path.join(directory, INDEX),
                                       lambda f: json.dump(index, f), mode="w")
    except BaseException:
        _durable.discard(tmp_data, tmp_index)  # and data_path, unless committed: commit_data_and_index's
        raise
    finally:
        if claim is not None:
            claim.files.difference_update(temporary)
    remove_leftovers(directory, keep=data_name)  # earlier offloads' data
    return locations


def data_path(directory):
    """The data file the index of `directory` names (read_index has checked it)."""
    with open(os.path.join(os.fspath(directory), INDEX), "rb") as f:
        return os.path.join(os.fspath(directory), strict_json(f.read(MAX_HEADER + 1), INDEX)["data"])


def recorded_source(directory):
    """The fingerprint of the checkpoint the offload_dir's weights derive from, or None when its index records
    none (weights written from a model, or by an earlier swapio)."""
    path = os.path.join(os.fspath(directory), INDEX)
    with open(path, "rb") as f:
        index = strict_json(f.read(MAX_HEADER + 1), path)
    source = index.get("source") if isinstance(index, dict) else None
    return source if isinstance(source, str) else None


def has_index(directory):
    return os.path.isfile(os.path.join(os.fspath(directory), INDEX))


_TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def read_index(directory):
    """{tensor name: Location} of an offload_dir written by swapio; ValueError naming the file on any defect (the
    index is a file from outside like any other: every field is checked before it is used)."""
    path = os.path.join(os.fspath(directory), INDEX)
    try:
        with open(path, "rb") as f:
            index = strict_json(f.read(MAX_HEADER + 1), path)
    except OSError as exc:
        raise ValueError(f"{path} is not a swapio offload index (cannot read it: {exc.strerror})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a swapio offload index")
    version = index.get("version")
    if type(version) is not int or version < 1:
        raise ValueError(f"{path}: version must be a positive int, got {version!r}")
    if version > VERSION:
        raise ValueError(f"{path} has format version {version}; this swapio reads up to {VERSION}")
    data, tensors = index.get("data"), index.get("tensors")
    if not isinstance(data, str) or not data.startswith(DATA_PREFIX) or not data.endswith(DATA_SUFFIX) \
            or os.path.basename(data) != data:
        raise ValueError(f"{path}: 'data' must name a {DATA_PREFIX}*{DATA_SUFFIX} file in the directory, got "
                         f"{data!r}")
    if not isinstance(tensors, dict):
        raise ValueError(f"{path}: 'tensors' must be an object, got {type(tensors).__name__}")
    data_path = os.path.join(os.fspath(directory), data)
    size = os.path.getsize(data_path) if os.path.isfile(data_path) and not os.path.islink(data_path) else -1
    out, ranges = {}, []
    for name, e in tensors.items():
        loc = _entry(path, data_path, size, name, e)
        for alias in e["names"]:
            if alias in out:
                raise ValueError(f"{path}: tensor name {alias!r} appears twice")
            out[alias] = loc
        if loc.nbytes:
            ranges.append((loc.offset, loc.offset + loc.nbytes, name))
    # swapio stores every tensor once in its own bytes (a tie is one entry with several names): tensors sharing
    # bytes would read each other's values, and a training step writing one would change the other
    ranges.sort()
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            raise ValueError(f"{path}: tensors {first!r} and {second!r} overlap in {data_path}")
    return out


def _entry(path, data_path, size, name, e):
    """The Location of one tensor entry of the index, every field checked."""
    def bad(why):
        return ValueError(f"{path}: tensor {name!r}: {why}")
    if not isinstance(e, dict):
        raise bad(f"the entry must be an object, got {type(e).__name__}")
    names, dtype, shape = e.get("names"), _TORCH_DTYPES.get(e.get("dtype")) if isinstance(e.get("dtype"), str) \
        else None, e.get("shape")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise bad(f"'names' must be a non-empty list of strings, got {e.get('names')!r}")
    if dtype is None:
        raise bad(f"'dtype' must name a torch dtype, got {e.get('dtype')!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"'shape' must be a list of non-negative ints, got {shape!r}")
    offset, nbytes = e.get("offset"), e.get("nbytes")
    for field, value in (("offset", offset), ("nbytes", nbytes)):
        if type(value) is not int or value < 0:
            raise bad(f"{field!r} must be a non-negative int, got {value!r}")
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise bad(f"'nbytes' is {nbytes} but shape {shape} of {dtype} has {math.prod(shape) * dtype.itemsize}")
    if offset + nbytes > size:
        raise ValueError(f"{data_path}: tensor {name!r} ends at byte {offset + nbytes} but the file has "
                         f"{max(size, 0)} bytes ({'missing' if size < 0 else 'truncated'})")
    return Location(data_path, offset, nbytes, dtype, tuple(shape))
