"""Version 4: the metadata of an optimizer checkpoint from its one safetensors file. swapio.checkpoint.load.locate
(the library's one reader) checks the header and structure and gives each array's Location in its place; this
turns that into read_meta's form, checking that no tensor hides where a plain value belongs and that each array
has the dtype and shape its field has in the checkpoint's state_dtype."""
import math
import os

import torch

from ...checkpoint.load import locate
from ...safetensors.header import Location
from ..state_format import StateFormat, shape_of_factors
from ..unstepped_weights import KEY as UNSTEPPED
from .files import FILE, FORMAT, MAX_GROUP_TENSOR_BYTES


def read_meta_v4(file):
    """read_meta's form of the version 4 checkpoint file `file` (ValueError naming the first problem)."""
    structure = locate(file)
    meta = _meta_of(structure, file)
    _check_arrays(structure["state"], meta, file)  # first: the checks of offsets take these sizes as given
    return meta


def _no_arrays(value, where):
    """ValueError if a tensor hides where plain values belong (a forged file)."""
    if isinstance(value, Location):
        raise ValueError(f"{where}: a tensor where a plain value belongs")
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for v in inner:
        _no_arrays(v, where)


def _dict(structure, key, where):
    value = structure.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key!r} must be a dict, got {type(value).__name__}")
    return value


def _checksum_value(text):
    """The int of a checksum as the header writes it (16 hex digits); anything else as it is, for
    validate.checkpoint_meta to refuse."""
    return int(text, 16) if isinstance(text, str) and len(text) == 16 and text.strip("0123456789abcdef") == "" \
        else text


def _meta_of(structure, file):
    """read_meta's form of a version 4 file's structure (each array's Location in its place)."""
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        raise ValueError(f"{file} is not a swapio optimizer checkpoint")
    state, dtypes, sums = (_dict(structure, key, file) for key in ("state", "param_dtypes", "checksums"))
    groups = _tensor_hyperparameters(structure.get("param_groups"), file)
    _no_arrays([groups] + [v for key, v in structure.items() if key not in ("state", "param_groups")], file)
    entries = {}
    for k, saved in state.items():
        where = f"{file}: parameter {k!r}"
        if not isinstance(saved, dict):
            raise ValueError(f"{where}: its entry must be a dict")
        fields = {name: loc for name, loc in saved.items() if name != "step"}
        _no_arrays(saved.get("step"), f"{where}: 'step'")
        for name, loc in fields.items():
            if not isinstance(name, str):
                raise ValueError(f"{where}: a field name must be a string, got {name!r}")
            if not isinstance(loc, Location):
                raise ValueError(f"{where}: {name!r} must be a tensor, got {type(loc).__name__}")
        shapes = [loc.shape for name, loc in fields.items()
                  if not StateFormat.is_scale(name) and not StateFormat.is_factor(name)]
        shape = tuple(shapes[0]) if shapes else _factored_shape(fields)
        checksums = sums.get(k)
        if not isinstance(checksums, dict):  # (only versions 1 of the old format had none)
            raise ValueError(f"{where}: 'checksums' has no dict of its fields' checksums")
        numel = None if shape is None else math.prod(shape)  # (a 0-d parameter's shape is (): 1 element)
        entries[k] = {"step": saved.get("step"), "shape": shape, "numel": numel,
                      "dtype": dtypes.get(k), "fields": {name: loc.offset for name, loc in fields.items()},
                      "checksums": {name: _checksum_value(c) for name, c in checksums.items()}}
    meta = {key: structure.get(key) for key in ("format", "version", "optimizer", "state_dtype", "checksum")}
    meta.update(param_groups=groups, state=entries, data=FILE, data_bytes=os.path.getsize(file))
    unstepped = structure.get(UNSTEPPED, {})
    meta[UNSTEPPED] = {k: _checksum_value(c) for k, c in unstepped.items()} if isinstance(unstepped, dict) \
        else unstepped  # (anything else for validate.checkpoint_meta to refuse)
    return meta


def _factored_shape(fields):
    """The parameter's shape from its factored second moments (Adafactor's row_var and col_var, when no field
    is shaped like the parameter: an fp32 parameter is its own master), else None."""
    row, col = fields.get("row_var"), fields.get("col_var")
    if row is None or col is None or len(row.shape) < 2 or len(row.shape) != len(col.shape):
        return None
    return shape_of_factors(tuple(row.shape), tuple(col.shape))


def _tensor_hyperparameters(groups, file):
    """The param groups with each tensor they hold (a tensor-valued hyperparameter, as torch's state_dict() holds
    it, or a small value of the user's, in a list, tuple or dict too: whatever save() wrote) read back as a new
    CPU tensor; a tensor in 'params' is left for _no_arrays to refuse. Hyperparameters' values are checked with
    the rest of the group (restore.check_groups). A tensor the groups shared when saved (save() stores it once:
    `lr=torch.tensor(...)` given to the constructor is every group's, as in torch) comes back as one tensor, as
    torch.load gives it: read once per group, a scheduler's in-place update of it (LambdaLR's fill_) then reached
    one group only, and the run resumed other than it went on uninterrupted."""
    if not isinstance(groups, list):
        return groups
    read = {}

    def value(v, where):
        if isinstance(v, Location):
            key = (v.path, v.offset, v.nbytes, v.dtype, tuple(v.shape))
            if key not in read:
                read[key] = _read_small(v, where)
            return read[key]
        if isinstance(v, (list, tuple)):  # betas as a pair of tensors
            return type(v)(value(x, where) for x in v)
        if isinstance(v, dict):
            return {k: value(x, where) for k, x in v.items()}
        return v
    return [{key: v if key == "params" else value(v, f"{file}: param group {i}: {key!r}")
             for key, v in g.items()} if isinstance(g, dict) else g for i, g in enumerate(groups)]


def _read_small(loc, where):
    if loc.nbytes > MAX_GROUP_TENSOR_BYTES:
        raise ValueError(f"{where}: a {loc.dtype} tensor of shape {list(loc.shape)} ({loc.nbytes} bytes) where a "
                         f"param group's value (a hyperparameter, at most {MAX_GROUP_TENSOR_BYTES} bytes) belongs")
    with open(loc.path, "rb") as f:
        f.seek(loc.offset)
        raw = f.read(loc.nbytes)
    if len(raw) != loc.nbytes:
        raise ValueError(f"{where}: the file ends inside the tensor")
    return torch.frombuffer(bytearray(raw), dtype=loc.dtype).reshape(tuple(loc.shape)).clone() if raw \
        else torch.empty(tuple(loc.shape), dtype=loc.dtype)


def _check_arrays(state, meta, file):
    """Each array is stored with the dtype and shape its field has in the checkpoint's state_dtype (the header's
    byte ranges are the reader's: whole, inside the file, not overlapping)."""
    fmt = StateFormat(meta.get("state_dtype", "fp32"))
    for k, saved in state.items():
        shape = meta["state"][k]["shape"]
        if shape is None:
            continue  # no moment: validate.checkpoint_meta refuses it
        for name in meta["state"][k]["fields"]:
            loc = saved[name]
            if fmt.is_factor(name) and len(shape) < 2:
                raise ValueError(f"{file}: parameter {k}: {name!r} belongs to a parameter of two or more "
                                 f"dimensions, not one of shape {list(shape)}")
            want = fmt.shape(name, shape)
            if loc.dtype != fmt.dtype(name) or tuple(loc.shape) != tuple(want):
                raise ValueError(f"{file}: parameter {k}: {name!r} is {loc.dtype} {list(loc.shape)}; state_dtype "
                                 f"{fmt.name!r} stores it as {fmt.dtype(name)} {list(want)}")
