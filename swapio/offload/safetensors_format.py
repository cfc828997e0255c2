"""Reading safetensors checkpoints without the safetensors library, mmap or a state dict.

A .safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the data, with each
tensor's bytes at 8 + N + begin. A checkpoint is such a file, a directory holding `model.safetensors` or the
sharded `model.safetensors.index.json` ({"weight_map": {name: shard file}}) that save_pretrained writes, or
that index file itself. Every defect (bad header, a tensor past the end of a truncated file) is a ValueError
naming the file and, where there is one, the tensor.
"""
import json
import math
import os
import struct

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
          "F64": torch.float64}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
for _name, _attr in (("C64", "complex64"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):  # names the safetensors library (>= 0.5) writes too
        DTYPES.setdefault(_name, getattr(torch, _attr))


class Location:
    """Where one tensor's bytes are: file, absolute offset, byte count, and what the file says it is."""

    __slots__ = ("path", "offset", "nbytes", "dtype", "shape")

    def __init__(self, path, offset, nbytes, dtype, shape):
        self.path, self.offset, self.nbytes, self.dtype, self.shape = path, offset, nbytes, dtype, shape

    def as_tuple(self):
        return self.path, self.offset, self.nbytes


def read_header(path):
    """{name: Location} for one .safetensors file; ValueError naming the file (and tensor) on any defect."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than its header length)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"{path}: not a safetensors file or truncated (header length {n}, file {size} "
                                 "bytes)")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    data_start = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed or unsupported header entry {entry!r}") \
                from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes:
            raise ValueError(f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but shape {list(shape)} of "
                             f"{entry['dtype']} needs {nbytes}")
        if data_start + end > size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has {size} "
                             "bytes (truncated)")
        out[name] = Location(path, data_start + begin, nbytes, dtype, shape)
    return out


def checkpoint_files(checkpoint):
    """The .safetensors files of a checkpoint path (file, directory, or index), and the index's weight map."""
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, SINGLE)):
            return [os.path.join(path, SINGLE)], None
        if os.path.isfile(os.path.join(path, INDEX)):
            path = os.path.join(path, INDEX)
        else:
            raise ValueError(f"checkpoint directory {path} has neither {SINGLE} nor {INDEX}")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} does not exist or is not a file")
    if not path.endswith(".json"):
        return [path], None
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}: not a safetensors index (needs a JSON object with a 'weight_map')") from None
    base = os.path.dirname(path)
    files = []
    for shard in weight_map.values():
        full = os.path.join(base, shard)
        if full not in files:
            files.append(full)
    for full in files:
        if not os.path.isfile(full):
            raise ValueError(f"{path} names shard {full}, which does not exist")
    return files, {name: os.path.join(base, shard) for name, shard in weight_map.items()}


def open_checkpoint(checkpoint):
    """{tensor name: Location} for a whole checkpoint (single file, directory, or sharded index)."""
    files, weight_map = checkpoint_files(checkpoint)
    out = {}
    for path in files:
        out.update(read_header(path))
    if weight_map is not None:
        for name, path in weight_map.items():
            if name not in out or out[name].path != path:
                raise ValueError(f"{path}: the index says it holds tensor {name!r}, but it does not")
    return out


def check_against(locations, name, shape, dtype, checkpoint):
    """The Location of a model tensor (any of its names), checked for shape and dtype; ValueError otherwise."""
    names = [name] if isinstance(name, str) else list(name)
    for n in names:
        loc = locations.get(n)
        if loc is None:
            continue
        if loc.shape != tuple(shape):
            raise ValueError(f"{loc.path}: tensor {n!r} has shape {list(loc.shape)}, the model expects "
                             f"{list(shape)}")
        if loc.dtype != dtype:
            raise ValueError(f"{loc.path}: tensor {n!r} is {loc.dtype}, the model expects {dtype} (build or cast "
                             "the model in the checkpoint's dtype)")
        return loc
    raise ValueError(f"checkpoint {os.fspath(checkpoint)} lacks tensor {names[0]!r}"
                     + (f" (also looked for {names[1:]})" if len(names) > 1 else ""))


def read_metadata(path):
    """The header's "__metadata__" ({str: str}, empty when absent) of a .safetensors file that read_header
    accepted; ValueError naming the file if it is not a JSON object of strings."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, MAX_HEADER)))
    except (struct.error, ValueError):
        raise ValueError(f"{path}: not a safetensors file (unreadable header)") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise ValueError(f"{path}: the safetensors __metadata__ must be a JSON object of strings")
    return metadata
