"""Checks of optimizer state that comes from outside: the metadata of a checkpoint that load() reads and the
state dict given to load_state_dict(). Files and dicts from elsewhere are hostile until shown well formed, so
every field is checked (type, shape, range, finiteness) before anything is installed, and a ValueError names the
first problem; the optimizer is then left exactly as it was (load and load_state_dict are all or nothing)."""
import math
import numbers
import re

import torch

from .state_format import SCALE, STATE_DTYPES, StateFormat

MAX_STEP = 2 ** 24  # steps are fp32 tensors (torch's format): whole numbers are exact up to here
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "row_var", "col_var", "variance")  # of every swapio rule
NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq", "row_var", "col_var", "variance")
PARAM_DTYPES = ("float32", "bfloat16", "float16")
_DATA_NAME = re.compile(r"swapio-optim-[0-9a-f]{1,64}\.bin")


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def has_values(name, value, where):
    """ValueError for a tensor on the meta device: it holds no values to load (a state dict read with
    map_location="meta", or made under torch.device("meta") / init_empty_weights), and copying it fails with
    torch's bare "Cannot copy out of meta tensor"."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise ValueError(f"{where}: {name!r} is on the meta device, which holds no values (a state dict loaded with "
                         "map_location='meta', or made under torch.device('meta')): load one whose tensors hold "
                         "the state")


def step_count(value, where):
    """The fp32 0-d tensor of a step count given as a whole number from 0 to 2**24: a number (older torch wrote
    ints) or a one-element real tensor."""
    has_values("step", value, where)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{where}: 'step' must be a one-element real tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        number = value.item()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = value
    else:
        raise ValueError(f"{where}: 'step' must be a number or a one-element tensor, got {type(value).__name__}")
    number = float(number)
    if not (math.isfinite(number) and 0 <= number <= MAX_STEP and number == int(number)):
        raise ValueError(f"{where}: 'step' must be a whole number from 0 to 2**24, got {number}")
    return torch.tensor(number, dtype=torch.float32)


def values(name, tensor, where):
    """Raises unless the stored or exported values of field `name` are usable: int8 scales finite, second moments
    and scales not negative. Moments may hold NaN or inf: torch's own optimizers store them after a gradient
    overflows (g * g = inf), and a run that met one must still resume (fp32 state keeps them, int8 drops both
    moments of such an element, as its kernel does). int8 codes are not checked (every code is valid)."""
    if tensor.dtype == torch.uint8:
        return
    t = tensor.detach()
    if name.endswith(SCALE) and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: {name!r} holds NaN or infinite values")
    if (name in NON_NEGATIVE or name.endswith(SCALE)) and bool((t < 0).any()):
        raise ValueError(f"{where}: {name!r} holds negative values")


def state_tensor(name, value, shape, param_shape, where):
    """A state dict's field: a real floating tensor of `shape` (the field's for a parameter of `param_shape`) with
    usable values. The shape, not only the element count: a state of parameters given in another order has the
    right counts but other shapes, which torch's step refuses; flattened, it would scramble the elements."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}: {name!r} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{where}: {name!r} must be a floating-point tensor, got {value.dtype}")
    if value.numel() != math.prod(shape):
        raise ValueError(f"{where}: {name!r} has {value.numel()} elements, needs {math.prod(shape)}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where}: {name!r} has shape {tuple(value.shape)}, but its parameter has shape "
                         f"{tuple(param_shape)} (needs {tuple(shape)}): was the state saved with the parameters in "
                         "another order? Give the optimizer its parameters in the order of the saved one")
    values(name, value, where)


def _require(ok, path, message):
    if not ok:
        raise ValueError(f"{path}: {message}")


def legacy_data_name(meta, path):
    """Raises unless a version <= 3 checkpoint's metadata (swapio-optim.pt) names its data file by a plain
    swapio-optim-<hex>.bin name in the checkpoint's directory."""
    data = meta.get("data")
    _require(isinstance(data, str) and _DATA_NAME.fullmatch(data) is not None, path,
             f"'data' must name a swapio-optim-<hex>.bin file beside it, got {data!r}")


def checkpoint_meta(meta, path, version, checksum_algorithm):
    """Raises unless the metadata of a checkpoint (swapio.optim.checkpoint.read_meta) is well formed: every field
    of the right type and range, each parameter's arrays inside the data file and not overlapping. What must also
    match the optimizer (the number of parameters, their shapes, the hyperparameters) is checked by load()."""
    _require(is_int(meta.get("version")) and 1 <= meta["version"] <= version, path,
             f"'version' must be an integer from 1 to {version}, got {meta.get('version')!r}")
    state_dtype = meta.get("state_dtype", "fp32")
    _require(state_dtype in STATE_DTYPES, path, f"'state_dtype' must be one of {list(STATE_DTYPES)}, "
             f"got {state_dtype!r}")
    _require(isinstance(meta.get("optimizer", ""), str), path, "'optimizer' must be a string")
    _require(meta.get("checksum", checksum_algorithm) == checksum_algorithm, path,
             f"'checksum' must be {checksum_algorithm!r}, got {meta.get('checksum')!r}")
    size = meta.get("data_bytes")
    _require(is_int(size) and size >= 0, path, f"'data_bytes' must be an integer >= 0, got {size!r}")
    groups = meta.get("param_groups")
    _require(isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                              for g in groups), path,
             "'param_groups' must be a list of dicts, each with a list 'params'")
    ids = [i for g in groups for i in g["params"]]
    # distinct but where a group holds one parameter twice: load() checks that against the optimizer's groups
    _require(all(is_int(i) for i in ids), path, "the 'params' of 'param_groups' must be integers")
    state = meta.get("state")
    _require(isinstance(state, dict), path, "'state' must be a dict")
    fmt, spans = StateFormat(state_dtype), []
    for k, entry in state.items():
        where = f"{path}: parameter {k!r}"
        _require(is_int(k) and k in ids, path, f"'state' has an entry {k!r} that is not a parameter of "
                 "'param_groups'")
        _require(isinstance(entry, dict), where, "its entry must be a dict")
        step_count(entry.get("step"), where)
        shape, numel = entry.get("shape"), entry.get("numel")
        _require(isinstance(shape, (tuple, list)) and all(is_int(d) and d >= 0 for d in shape), where,
                 f"'shape' must be a sequence of integers >= 0, got {shape!r}")
        _require(is_int(numel) and numel == math.prod(shape), where,
                 f"'numel' must be the product of 'shape' {tuple(shape)}, got {numel!r}")
        _require(entry.get("dtype", "float32") in PARAM_DTYPES, where,
                 f"'dtype' must be one of {list(PARAM_DTYPES)}, got {entry.get('dtype')!r}")
        fields = entry.get("fields")
        _require(isinstance(fields, dict) and fields, where, "'fields' must be a non-empty dict")
        for name, off in fields.items():
            _require(isinstance(name, str), where, f"a field name must be a string, got {name!r}")
            known = name == "master" or name in MOMENTS or (fmt.has_scales and name[:-len(SCALE)] in MOMENTS
                                                             and name.endswith(SCALE))
            _require(known, where, f"unknown field {name!r} for state_dtype {state_dtype!r}")
            if fmt.is_scale(name):
                _require(name[:-len(SCALE)] in fields, where, f"has {name!r} without its moment")
            elif fmt.has_scales and name in MOMENTS:
                _require(name + SCALE in fields, where, f"int8 moment {name!r} has no {name + SCALE!r}")
            if fmt.is_factor(name):
                _require(len(shape) >= 2, where, f"{name!r} needs a parameter of two or more dimensions, got "
                         f"shape {tuple(shape)}")
            nbytes = fmt.count(name, numel, shape) * fmt.dtype(name).itemsize
            _require(is_int(off) and 0 <= off and off + nbytes <= size, where,
                     f"field {name!r} at offset {off!r} ({nbytes} bytes) lies outside the data file's {size} bytes")
            if nbytes:
                spans.append((off, off + nbytes, k, name))
        checksums = entry.get("checksums")
        _require(checksums is None or (isinstance(checksums, dict) and set(checksums) == set(fields) and all(
            is_int(c) and 0 <= c < 2 ** 64 for c in checksums.values())), where,
            "'checksums' must map each field to a 64-bit unsigned integer")
    spans.sort()
    for (_, end, k1, n1), (start, _, k2, n2) in zip(spans, spans[1:]):
        _require(start >= end, path, f"field {n1!r} of parameter {k1} and field {n2!r} of parameter {k2} overlap "
                 "in the data file")
    unstepped = meta.get("unstepped_weights", {})  # (swapio.optim.unstepped_weights.KEY)
    _require(isinstance(unstepped, dict) and all(
        is_int(k) and k in ids and k not in state and is_int(c) and 0 <= c < 2 ** 64 for k, c in unstepped.items()),
        path, "'unstepped_weights' must map parameters without state to 64-bit unsigned integers")
