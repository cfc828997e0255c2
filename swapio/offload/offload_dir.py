"""offload_dir: the model's weights written once, streamed, in a layout read back with single aligned requests.

Files: `swapio-weights-<token>.bin` holds the records one after the other, each starting at a 4 KiB boundary
with its tensors at 64-byte boundaries (so a record is one O_DIRECT read into a pinned region);
`swapio-weights.json` names that file and, per tensor, its names, offset, byte count, dtype and shape.
Writing never holds more than two staging chunks beyond the model itself: tensors are copied chunk by chunk into
pinned buffers and written while the next chunk fills. The space is reserved first (a full disk fails before a
byte is written), the data file is fsynced and renamed, then the index is written, fsynced and renamed over the
old one (the commit point). Any failure removes everything this call created: nothing partial is left.
"""
import errno
import json
import os
import secrets

import torch

from .. import _durable
from ..pinned import empty_pinned
from .layout import ALIGN, round_up
from .safetensors_format import Location

from .dir_owner import DATA_PREFIX, DATA_SUFFIX, INDEX, remove_leftovers
FORMAT, VERSION = "swapio.offload", 1
CHUNK = 64 << 20


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _reserve(path, nbytes):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise OSError(exc.errno, f"cannot reserve {nbytes} bytes for the offloaded weights: "
                                         f"{os.strerror(exc.errno)}", path) from None
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _stream(handle, path, pieces, total, chunk):
    """Writes `pieces` [(file offset, nbytes, getter of a uint8 1-D tensor)], sorted and not overlapping,
    zero-filling the rest of [0, total), through two pinned chunks. Each getter is called once, when its
    bytes are reached, so at most one tensor's contiguous copy exists at a time."""
    chunk = max(ALIGN, min(chunk, round_up(total)))
    bufs, pending = [empty_pinned(chunk, torch.uint8) for _ in range(2)], [None, None]
    k = i = 0
    data = None
    try:
        for window in range(0, total, chunk):
            buf, length = bufs[k], min(chunk, total - window)
            if pending[k] is not None:
                pending[k].wait()
                pending[k] = None
            buf[:length].zero_()
            while i < len(pieces) and pieces[i][0] < window + length:
                offset, nbytes, getter = pieces[i]
                if data is None:
                    data = getter()
                a, b = max(offset, window), min(offset + nbytes, window + length)
                if a < b:
                    buf[a - window:b - window].copy_(data[a - offset:b - offset])
                if offset + nbytes > window + length:
                    break  # continues in the next window
                data = None
                i += 1
            pending[k] = handle.pwrite(buf[:length], path, window)
            k ^= 1
    finally:
        error = None
        for f in pending:
            if f is not None:
                try:
                    f.wait()
                except OSError as exc:
                    error = error or exc
        if error is not None:
            raise error


def write(directory, records, source_of, handle, chunk=CHUNK, owner=None):
    """Writes every slot of `records` (packed layout) from source_of(slot), a tensor on any device, into
    `directory`, which the caller claimed (dir_owner.claim; `owner`: its claim, told which files a SIGTERM
    should remove). Returns {slot: (path, offset, nbytes)}."""
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
                                  "dtype": _dtype_name(slot.dtype), "shape": list(slot.shape)}
        end += record.nbytes
    temporary = (tmp_data, tmp_index)
    if owner is not None:
        owner.files.update(temporary)
    try:
        _reserve(tmp_data, end)
        for slot, (_, offset, _) in sorted(locations.items(), key=lambda kv: kv[1][1]):
            if slot.nbytes:
                pieces.append((offset, slot.nbytes,
                               lambda s=slot: source_of(s).detach().contiguous().reshape(-1).view(torch.uint8)))
        _stream(handle, tmp_data, pieces, end, chunk)
        pieces.clear()
        _durable.publish(tmp_data, data_path)
        index = {"format": FORMAT, "version": VERSION, "data": data_name, "data_bytes": end, "tensors": entries}
        _durable.write_and_replace(tmp_index, os.path.join(directory, INDEX), lambda f: json.dump(index, f),
                                   mode="w")
    except BaseException:
        _durable.discard(tmp_data, tmp_index, data_path)
        raise
    finally:
        if owner is not None:
            owner.files.difference_update(temporary)
    remove_leftovers(directory, keep=data_name)  # earlier offloads' data
    return locations


def has_index(directory):
    return os.path.isfile(os.path.join(os.fspath(directory), INDEX))


def read_index(directory):
    """{tensor name: Location} of an offload_dir written by swapio; ValueError naming the file on defects."""
    path = os.path.join(os.fspath(directory), INDEX)
    try:
        with open(path) as f:
            index = json.load(f)
        if index.get("format") != FORMAT:
            raise ValueError
        data_path = os.path.join(os.fspath(directory), index["data"])
        tensors = index["tensors"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{path} is not a swapio offload index") from None
    if index.get("version", 0) > VERSION:
        raise ValueError(f"{path} has format version {index['version']}; this swapio reads up to {VERSION}")
    size = os.path.getsize(data_path) if os.path.isfile(data_path) else -1
    out = {}
    for name, e in tensors.items():
        dtype = getattr(torch, e["dtype"])
        if e["offset"] + e["nbytes"] > size:
            raise ValueError(f"{data_path}: tensor {name!r} ends at byte {e['offset'] + e['nbytes']} but the file "
                             f"has {max(size, 0)} bytes ({'missing' if size < 0 else 'truncated'})")
        loc = Location(data_path, e["offset"], e["nbytes"], dtype, tuple(e["shape"]))
        for alias in e["names"]:
            out[alias] = loc
    return out
