"""Reading safetensors checkpoints without the safetensors library, mmap or a state dict.

A .safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the data, with each
tensor's bytes at 8 + N + begin. A checkpoint is such a file, a directory holding `model.safetensors` or the
sharded `model.safetensors.index.json` ({"weight_map": {name: shard file}}) that save_pretrained writes, or
that index file itself. Every defect (bad header, a tensor past the end of a truncated file) is a ValueError
naming the file and, where there is one, the tensor.
"""
import os
import struct

from .safetensors_header import (DTYPES, MAX_HEADER, Location, parse, parse_header,  # noqa: F401 - re-exported
                                 strict_json)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_header(path):
    """{name: Location} for one .safetensors file; ValueError naming the file (and tensor) on any defect."""
    return parse(path, *_raw_header(path))


def read_metadata(path):
    """The header's "__metadata__" ({str: str}, empty when absent) of one .safetensors file, read by the same
    validating parser as read_header: a file read_header refuses is the same ValueError here."""
    return parse_header(path, *_raw_header(path))[1]


def _raw_header(path):
    """(the header's JSON bytes, the file's size) of one .safetensors file; ValueError naming it if it cannot
    hold a header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file or truncated (header length {n}, file {size} "
                             "bytes)")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"{path}: the file shrank while its header was read ({len(raw)} of {n} bytes)")
    return raw, size


def _confined(base, shard, index_path):
    """The path of shard `shard` named by the index at index_path, in directory base; ValueError unless it is a
    relative name of a file inside base. A link is followed only to a file inside base or inside the directory
    the index itself really lives in (the Hugging Face cache keeps a snapshot's files as links into blobs/)."""
    if not isinstance(shard, str) or not shard or "\0" in shard:
        raise ValueError(f"{index_path}: a weight_map entry must be a shard file name, got {shard!r}")
    if os.path.isabs(shard) or os.pardir in shard.replace("\\", "/").split("/"):
        raise ValueError(f"{index_path}: shard {shard!r} lies outside the checkpoint directory {base} (absolute, "
                         "or with '..'): refused")
    full = os.path.join(base, shard)
    real = os.path.realpath(full)
    allowed = {os.path.realpath(base), os.path.dirname(os.path.realpath(index_path))}
    if not any(os.path.commonpath([real, d]) == d for d in allowed):
        raise ValueError(f"{index_path}: shard {shard!r} is a link to {real}, outside the checkpoint directory "
                         f"{base}: refused")
    return full


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
    with open(path, "rb") as f:
        index = strict_json(f.read(MAX_HEADER + 1), path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path}: not a safetensors index (needs a JSON object with a 'weight_map')")
    if not weight_map:
        raise ValueError(f"{path}: the index's 'weight_map' is empty: it names no tensor and no shard file")
    base = os.path.dirname(path)
    by_name = {name: _confined(base, shard, path) for name, shard in weight_map.items()}
    files = list(dict.fromkeys(by_name.values()))
    for full in files:
        if not os.path.isfile(full):
            raise ValueError(f"{path} names shard {full}, which does not exist")
    return files, by_name


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

