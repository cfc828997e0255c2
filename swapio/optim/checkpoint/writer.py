"""Saving an optimizer's checkpoint: one safetensors file (swapio-optim.safetensors) that never holds a second copy
of the state. The header is planned with meta tensors standing for the arrays (swapio.checkpoint.format.plan_state,
the layout swapio.checkpoint.load reads back as a state dict); swapio.safetensors.FileWriter writes it: the arrays
stream chunk by chunk through the optimizer's pinned buffers (nvme mode) or straight from the state tensors (cpu
mode) as positional O_DIRECT writes at their planned offsets (its `stream`), and the header, its checksums then
known (fixed-width, so it keeps its size), goes last through a small staging window. The file is committed as
every swapio checkpoint is (a locked temporary file, fsync, rename, directory fsync)."""
import numbers
import os

import torch

from ... import _progress
from ...checkpoint.format import plan_state
from ...core import _checksum
from ...safetensors.dtypes import dtype_name
from ...safetensors.file_writer import FileWriter
from .. import state_transfer, unstepped_weights, validate
from ..params import shard
from .files import FILE, FORMAT, MAX_GROUP_TENSOR_BYTES, VERSION
from .restore import check_groups

_UNSET = "0" * 16  # a checksum's place in the header while the arrays stream: as long as any, so the header
#                    keeps its size (and the arrays their offsets) when the checksums are filled in
STAGING = 4 << 20  # pinned staging for the header: the arrays stream through the optimizer's own buffers


def _as_stepped(value):
    """A hyperparameter as the step read it, in a type a checkpoint stores: a NumPy scalar (or another Real) as
    the Python number it equals, a pair element by element; tensors and plain values as they are."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_as_stepped(v) for v in value)
    if isinstance(value, (bool, torch.Tensor)) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def _plain_groups(opt, groups):
    """The packed groups with their values as the step used them: torch lets a group hold a NumPy lr or a flag
    given as 1 (the step reads float(lr), bool(flag)), which the checkpoint's structure cannot store (TypeError)
    or load() refuses (its flags must be bools), so save() would fail after training, or write a checkpoint
    that does not load."""
    flags = {k for k, v in type(opt)._historical_defaults.items() if isinstance(v, bool)}  # amsgrad, maximize...
    for i, g in enumerate(groups):
        for k, v in g.items():
            if k != "params":
                _check_group_tensors(v, f"param group {i}: {k!r}")
    return [{k: v if k == "params" else bool(v) if k in flags else _as_stepped(v) for k, v in g.items()}
            for g in groups]


def _check_group_tensors(value, where):
    """ValueError, before anything is written, for a tensor in a param group that load() would refuse: one larger
    than a hyperparameter may be (load() bounds what a file makes it read outside the state)."""
    if isinstance(value, torch.Tensor):
        nbytes = value.numel() * value.element_size()
        if nbytes > MAX_GROUP_TENSOR_BYTES:
            raise ValueError(f"{where} holds a tensor of shape {tuple(value.shape)} ({nbytes} bytes): a checkpoint "
                             f"keeps a param group's tensors up to {MAX_GROUP_TENSOR_BYTES} bytes (hyperparameters, "
                             "small values). Keep a larger one outside the param group, or save with "
                             "torch.save(opt.state_dict())")
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_group_tensors(v, where)
    elif isinstance(value, dict):
        for v in value.values():
            _check_group_tensors(v, where)


def _structure(opt):
    """(the checkpoint's structure, its arrays' meta placeholders {(index, field): tensor}, [stateful params],
    {id(p): index}): every array as a meta tensor of its stored dtype and shape, the checksums unset."""
    groups, index = state_transfer.pack_groups(opt.param_groups)
    groups = _plain_groups(opt, groups)
    fields_of, fmt = opt.exported_fields(), opt.state_format
    state, dtypes, sums, slots, stateful = {}, {}, {}, {}, []
    for group in opt.param_groups:
        for p in group["params"]:
            k = index[id(p)]
            if not opt.state.get(p) or k in state:
                continue
            stateful.append(p)
            t = shard(p)
            state[k] = {"step": int(validate.step_count(opt.state[p]["step"], f"optimizer.state[p]['step'] of "
                                                          f"parameter {k}").item())}
            for name in fields_of[p]:
                shape = fmt.shape(name, t.shape)
                state[k][name] = slots[k, name] = torch.empty(shape, dtype=fmt.dtype(name), device="meta")
            dtypes[k], sums[k] = dtype_name(t.dtype), dict.fromkeys(fields_of[p], _UNSET)
    structure = {"format": FORMAT, "version": VERSION, "optimizer": type(opt).__name__, "state_dtype": fmt.name,
                 "checksum": _checksum.ALGORITHM, "param_groups": groups, "state": state, "param_dtypes": dtypes,
                 "checksums": sums}
    unstepped = unstepped_weights.checksums(opt, index, state)
    if unstepped:  # (absent otherwise: such files are as before)
        structure[unstepped_weights.KEY] = {k: f"{c:016x}" for k, c in unstepped.items()}
    return structure, slots, stateful, index


def _finish_header(plan, structure, streams):
    """Writes the arrays' checksums into the planned header, in place (the same size: _UNSET)."""
    for (k, name), stream in streams.items():
        structure["checksums"][k][name] = f"{stream.intdigest():016x}"
    final = plan_state(structure, placeholders=True)
    if final.header.numel() != plan.header.numel() or final.offsets != plan.offsets:
        raise AssertionError("the optimizer checkpoint's header changed size with its checksums")
    plan.header.copy_(final.header)


def write_file(opt, path, progress=False):
    """Writes and commits opt's checkpoint file in the directory `path` (see the module)."""
    structure, slots, stateful, index = _structure(opt)
    # a group as written that load() would refuse (transformers.Adafactor's keys set by an edit of param_groups):
    # refused before anything is written, rather than a checkpoint put in place of a loadable one
    check_groups(opt, structure["param_groups"], f"{os.path.join(path, FILE)}: not saved")
    plan = plan_state(structure, placeholders=True)
    with FileWriter(os.path.join(path, FILE), plan) as f:
        at = {id(e.original): offset for e, offset in zip(plan.entries, plan.offsets)}
        offsets = {key: at[id(t)] for key, t in slots.items()}
        streams = {key: _checksum.Stream() for key in slots}  # (an empty array's is never fed)
        total = sum(t.numel() * t.element_size() for t in slots.values())
        with _progress.byte_bar(progress, total, "swapio: saving optimizer") as bar, \
                state_transfer.io_handles(opt) as (_, wh):
            def stream(write):
                _stream_arrays(opt, stateful, index, offsets, streams, write, bar)
                _finish_header(plan, structure, streams)

            f.write(staging_bytes=STAGING, handle=wh, stream=stream)  # the header staged; the arrays streamed
        f.commit()


def _stream_arrays(opt, params, index, offsets, streams, write, bar):
    """Writes the stored arrays of params piece by piece as opt.read_state hands them over: each piece at its
    array's offset ({(index, field): offset}) plus its place in the array, fed to its checksum stream."""
    fmt, fields_of = opt.state_format, opt.exported_fields()

    def sink(p, a, b, views):
        futures, k = [], index[id(p)]
        for name in fields_of[p]:
            view, first = views[name], fmt.first(name, a)
            streams[k, name].update(first, view)
            futures.append(write(offsets[k, name] + first * view.element_size(), view))
            if bar is not None:  # written when the future finishes; queued now, close enough to watch
                bar.update(view.nbytes)
        return futures

    opt.read_state(params, sink)
