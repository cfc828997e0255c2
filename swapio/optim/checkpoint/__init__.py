"""Streaming, atomic checkpoints of the offloaded optimizers (opt.save(dir) / opt.load(dir)).

A checkpoint is a directory holding one file, swapio-optim.safetensors, written by swapio.checkpoint's machinery
(the one writer in the library: layout, commit, save): a safetensors file that safetensors.torch.load_file reads
and swapio.checkpoint.load(file) returns as an optimizer state dict,
    {"format", "version" (4), "optimizer" (the class), "state_dtype", "checksum" (the algorithm),
     "param_groups": as in state_dict(),
     "state": {index: {"step": int, "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"][, "master"][, "<moment>_scale"]}},
     "param_dtypes": {index: the parameter's dtype}, "checksums": {index: {field: xxh3-64, 16 hex digits}}}
whose tensors are the arrays as the optimizer stores them (swapio.optim.state_format): fp32, bf16 or int8-code
moments shaped like the parameter, fp32 masters (bf16/fp16 parameters only), flat fp32 int8 block scales.

Saving never holds a second copy of the state: the header is planned with meta tensors standing for the arrays
(layout.plan), the arrays stream chunk by chunk through the optimizer's pinned buffers (nvme mode) or straight
from the state tensors (cpu mode) as positional O_DIRECT writes at their planned offsets (save.write_pending's
stream), and the header, its checksums then known (fixed-width, so it keeps its size), goes last through the
staging window. The file is committed as every swapio checkpoint is (commit.PendingFile: a locked temporary file,
fsync, rename, directory fsync): a crash or a signal at any moment leaves the previous checkpoint or the new one.
A save holds the directory's flock (swapio.optim.dir_lock) exclusively, a load shared: a save while another live
process saves or loads there raises OSError(EBUSY); a save removes what killed saves left (their temporary
files) and, after its commit, the files of a version <= 3 checkpoint.

load() is all or nothing: it validates the header and structure (swapio.checkpoint.load.locate: the library's one
reader) and the metadata, reads every array into new storage (new tensors in cpu mode, a new swap file in nvme
mode: the disk briefly holds both), verifies the checksums, and only then swaps the new state in; a failure at
any point leaves the optimizer exactly as it was. A checkpoint from either mode loads into either mode; one of
another state_dtype loads too (its moments decoded to fp32 and stored in this optimizer's format).

Versions <= 3 (swapio-optim.pt, torch.save metadata with offsets and checksums, beside a raw
swapio-optim-<hex>.bin) still load: only where the offsets and checksums come from differs (read_meta).
"""
import contextlib
import errno
import math
import os
import stat

import torch

from .. import _progress
from ..checkpoint import commit, layout
from ..checkpoint.dtypes import dtype_name
from ..checkpoint.load import locate
from ..checkpoint.save import commit_pending, prepare, split_pieces, staging_for, write_pending
from ..checkpoint.structure import flatten
from ..core import _checksum, _durable
from ..offload.safetensors_header import Location
from . import dir_lock, state_transfer, validate
from .params import shard
from .state_format import SCALE, StateFormat, shape_of_factors

FILE = "swapio-optim.safetensors"
FORMAT = "swapio.optim.checkpoint"
VERSION = 4  # 2: checksums; 3: state_dtype (bf16/int8 arrays); 4: one safetensors file
_UNSET = "0" * 16  # a checksum's place in the header while the arrays stream: as long as any, so the header
#                    keeps its size (and the arrays their offsets) when the checksums are filled in
STAGING = 4 << 20  # pinned staging for the header: the arrays stream through the optimizer's own buffers
LEGACY_META = "swapio-optim.pt"  # versions <= 3: this metadata and a swapio-optim-<hex>.bin, read only
_LEGACY = (("swapio-optim-", (".bin", ".bin.tmp")), (f".{LEGACY_META}.", (".tmp",)))  # (prefix, suffixes)


def _bar(progress, total, desc):
    """A bar of bytes on stderr when swapio._progress's rule wants one (see OffloadOptimizer.save), else None."""
    return _progress.bar(progress, total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


@contextlib.contextmanager
def _closing(bar):
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def save(opt, path, progress=False):
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with dir_lock.locked(path, exclusive=True):
        _save(opt, path, progress)
        # the files this checkpoint replaced: the previous one (unlinked by a helper thread), a version <= 3 one
        commit.wait_for_unlinks()
        _durable.discard(os.path.join(path, LEGACY_META))
        for prefix, suffixes in _LEGACY:
            _durable.remove_others(path, prefix, suffixes, keep=None)


def _structure(opt):
    """(the checkpoint's structure, its arrays' meta placeholders {(index, field): tensor}, [stateful params],
    {id(p): index}): every array as a meta tensor of its stored dtype and shape, the checksums unset."""
    groups, index = state_transfer.pack_groups(opt.param_groups)
    fields_of, fmt = opt.exported_fields(), opt.state_format
    state, dtypes, sums, slots, stateful = {}, {}, {}, {}, []
    for group in opt.param_groups:
        for p in group["params"]:
            k = index[id(p)]
            if not opt.state.get(p) or k in state:
                continue
            stateful.append(p)
            t = shard(p)
            state[k] = {"step": int(opt.state[p]["step"].item())}
            for name in fields_of[p]:
                shape = fmt.shape(name, t.shape)
                state[k][name] = slots[k, name] = torch.empty(shape, dtype=fmt.dtype(name), device="meta")
            dtypes[k], sums[k] = dtype_name(t.dtype), dict.fromkeys(fields_of[p], _UNSET)
    structure = {"format": FORMAT, "version": VERSION, "optimizer": type(opt).__name__, "state_dtype": fmt.name,
                 "checksum": _checksum.ALGORITHM, "param_groups": groups, "state": state, "param_dtypes": dtypes,
                 "checksums": sums}
    return structure, slots, stateful, index


def _finish_header(plan, structure, streams):
    """Writes the arrays' checksums into the planned header, in place (the same size: _UNSET)."""
    for (k, name), stream in streams.items():
        structure["checksums"][k][name] = f"{stream.intdigest():016x}"
    final = layout.plan(*flatten(structure, placeholders=True))
    if final.header.numel() != plan.header.numel() or final.offsets != plan.offsets:
        raise AssertionError("the optimizer checkpoint's header changed size with its checksums")
    plan.header.copy_(final.header)


def _save(opt, path, progress=False):
    structure, slots, stateful, index = _structure(opt)
    plan, pending = prepare(structure, os.path.join(path, FILE), placeholders=True)
    try:
        at = {id(e.original): offset for e, offset in zip(plan.entries, plan.offsets)}
        offsets = {key: at[id(t)] for key, t in slots.items()}
        streams = {key: _checksum.Stream() for key in slots}  # (an empty array's is never fed)
        pieces, segments, _ = split_pieces(plan)  # the header alone: every array is a placeholder
        staging = staging_for(segments, STAGING)
        total = sum(t.numel() * t.element_size() for t in slots.values())
        with _closing(_bar(progress, total, "swapio: saving optimizer")) as bar, \
                state_transfer.io_handles(opt) as (_, wh):
            def stream(write):
                _stream_arrays(opt, stateful, index, offsets, streams, write, bar)
                _finish_header(plan, structure, streams)

            write_pending(plan, pending, pieces, staging, wh, segments=segments, stream=stream)
        commit_pending(pending, plan.total)
    finally:
        pending.abort()  # a no-op once committed


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


def read_meta(path):
    """The checkpoint's metadata, validated (swapio.optim.validate), in one form for every version: format,
    version, optimizer, state_dtype, checksum, param_groups, data (the file holding the arrays, in `path`),
    data_bytes, and state {index: {step, shape, numel, dtype (the parameter's), fields {field: byte offset in
    data}, checksums {field: int}}}. ValueError naming the first problem."""
    path = os.fspath(path)
    where = os.path.join(path, FILE)
    if _regular(where):  # a version <= 3 checkpoint beside it is older: a save removes it after its commit
        structure = locate(where)
        meta = _meta_of(structure, where)
        _check_arrays(structure["state"], meta, where)  # first: the checks of offsets take these sizes as given
    else:
        where = os.path.join(path, LEGACY_META)
        if not os.path.lexists(where):
            raise FileNotFoundError(f"{path}: no swapio optimizer checkpoint ({FILE} is missing)")
        meta = _legacy_meta(where)
    validate.checkpoint_meta(meta, where, VERSION, _checksum.ALGORITHM)
    meta["file"] = where  # what errors name
    return meta


def _kind(mode):
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a regular file")


def _regular(where):
    """True for a regular file (symlinks followed), False when nothing is there; ValueError for anything else
    there (a directory, a FIFO that would block the reader, a device): never reported as missing."""
    try:
        mode = os.stat(where).st_mode
    except FileNotFoundError:
        if os.path.islink(where):
            raise FileNotFoundError(errno.ENOENT, "a dangling symlink in place of the checkpoint file", where) \
                from None
        return False
    if not stat.S_ISREG(mode):
        raise ValueError(f"{where} is {_kind(mode)}, not a checkpoint file")
    return True


def _legacy_meta(meta_path):
    # opened without blocking and checked before torch.load reads it: a FIFO in its place would hang the load
    fd = os.open(meta_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{meta_path} is {_kind(mode)}, not a checkpoint file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    try:
        with f:
            meta = torch.load(f, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler makes of a damaged file
        raise ValueError(f"{meta_path} is not a readable swapio optimizer checkpoint: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a swapio optimizer checkpoint")
    validate.legacy_data_name(meta, meta_path)
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
    return meta


def _factored_shape(fields):
    """The parameter's shape from its factored second moments (Adafactor's row_var and col_var, when no field
    is shaped like the parameter: an fp32 parameter is its own master), else None."""
    row, col = fields.get("row_var"), fields.get("col_var")
    if row is None or col is None or len(row.shape) < 2 or len(row.shape) != len(col.shape):
        return None
    return shape_of_factors(tuple(row.shape), tuple(col.shape))


MAX_HYPER_BYTES = 4096  # a tensor-valued hyperparameter (lr=torch.tensor(...), as torch allows) is a scalar


def _tensor_hyperparameters(groups, file):
    """The param groups with each tensor-valued hyperparameter (saved as a tensor, as torch's state_dict() holds
    it) read back as a new CPU tensor; a tensor anywhere else in a group ('params') is left for _no_arrays to
    refuse. Their values are checked with the rest of the group (_check_groups)."""
    if not isinstance(groups, list):
        return groups
    def value(v, where):
        if isinstance(v, Location):
            return _read_small(v, where)
        if isinstance(v, (list, tuple)):  # betas as a pair of tensors
            return type(v)(value(x, where) for x in v)
        return v
    return [{key: v if key == "params" else value(v, f"{file}: param group {i}: {key!r}")
             for key, v in g.items()} if isinstance(g, dict) else g for i, g in enumerate(groups)]


def _read_small(loc, where):
    if loc.nbytes > MAX_HYPER_BYTES or not (loc.dtype.is_floating_point or loc.dtype == torch.int64):
        raise ValueError(f"{where}: a {loc.dtype} tensor of shape {list(loc.shape)} where a hyperparameter (a "
                         "number or a one-element tensor) belongs")
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
        numel, shape = meta["state"][k]["numel"], meta["state"][k]["shape"]
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


def load(opt, path, progress=False):
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no swapio optimizer checkpoint directory", path)
    with dir_lock.locked(path, exclusive=False):  # no save removes the files while they are read
        _load(opt, path, progress)


def _load(opt, path, progress=False):
    meta = read_meta(path)
    saved_fmt = StateFormat(meta.get("state_dtype", "fp32"))
    fmt = opt.state_format
    data_path = os.path.join(path, meta["data"])
    size = os.path.getsize(data_path) if _regular(data_path) else -1
    if size < meta["data_bytes"]:
        raise ValueError(f"{data_path}: {'missing' if size < 0 else f'{size} bytes'}; the checkpoint needs "
                         f"{meta['data_bytes']} bytes")
    file = meta["file"]
    try:
        id_map, new_groups = state_transfer.remap_groups(opt.param_groups, meta["param_groups"])
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}{_saved_by(opt, meta.get('optimizer'))}") from None
    _check_same_parameters(opt.param_groups, meta["param_groups"], file)
    _check_groups(opt, new_groups, file, meta.get("optimizer"))
    steps, fields, offsets, expected = {}, {}, {}, {}
    for k, entry in meta["state"].items():
        p = id_map[k]
        t = shard(p)
        if tuple(entry["shape"]) != tuple(t.shape):
            raise ValueError(f"{file}: parameter {k} has shape {tuple(t.shape)}; its checkpointed state is for "
                             f"shape {tuple(entry['shape'])}")
        saved_dtype = entry.get("dtype", "float32")
        if opt.is_offloaded(p) and saved_dtype != str(t.dtype).replace("torch.", ""):
            # its weights are rewritten from the loaded master in the offload storage's dtype: a checkpoint of
            # another model (a resident parameter may change dtype between runs, as with torch)
            raise ValueError(f"{file}: parameter {k} is an offloaded weight of dtype {t.dtype}; its checkpointed "
                             f"state is for a weight of dtype {saved_dtype}")
        steps[p] = validate.step_count(entry["step"], f"{file}: parameter {k}")
        fields[p] = {name for name in entry["fields"] if not saved_fmt.is_scale(name)}
        offsets[p] = entry["fields"]
        expected[p] = (k, entry.get("checksums"))
    sums, bad = {}, []
    # the bar counts the bytes read; a field this optimizer does not keep is not read, so it may stop short
    total = sum(saved_fmt.count(name, entry["numel"], entry["shape"]) * saved_fmt.dtype(name).itemsize
                for entry in meta["state"].values() for name in entry["fields"])
    bar = _bar(progress, total, "swapio: loading optimizer")
    with _closing(bar), state_transfer.io_handles(opt) as (rh, _):
        def read(p, name, a, view):
            """Reads the stored elements of `name` for parameter elements from a into view (a future), feeding
            the checksum and checking the values once they are in."""
            first = saved_fmt.first(name, a)
            stream = sums.setdefault(p, {}).setdefault(name, _checksum.Stream())

            def arrived(n):
                if bar is not None:
                    bar.update(view.nbytes)
                stream.update(first, view)
                try:
                    validate.values(name, view, f"{data_path}: parameter {expected[p][0]}")
                except ValueError as exc:
                    bad.append(exc)
                return n

            return rh.pread(view, data_path, offsets[p][name] + first * view.element_size())._chain(arrived)

        def source(p, a, b, views):
            if saved_fmt == fmt:  # as stored: straight into the views
                return [read(p, name, a, view) for name, view in views.items()]
            saved = {}  # another format: read what the views need, decode to fp32, store in ours
            for name in views:
                for stored in (name, name + SCALE):
                    if stored in offsets[p] and not fmt.is_scale(name):
                        saved[stored] = torch.empty(saved_fmt.count(stored, b - a), dtype=saved_fmt.dtype(stored))
                        read(p, stored, a, saved[stored]).wait()
            fmt.encode_fields(views, {name: saved_fmt.decode(saved, name) for name in views if not fmt.is_scale(name)})
            return []

        def check():
            if bad:
                raise bad[0]
            for p, (k, checksums) in expected.items():
                for name, stream in sums.get(p, {}).items():  # the arrays read: others were not used
                    want, got = (checksums or {}).get(name), stream.intdigest()
                    if want is not None and got != want:
                        raise ValueError(f"{data_path}: checksum mismatch in {name!r} of parameter {k} "
                                         f"({_checksum.ALGORITHM} {got:016x}, saved {want:016x}): the file is "
                                         "corrupted; the optimizer state was left as it was")

        try:
            state_transfer.install(opt, new_groups, steps, fields, source, check=check)
        except ValueError as exc:  # a mismatch with this optimizer (its fields, amsgrad with int8 state)
            if file in str(exc) or data_path in str(exc):
                raise
            raise ValueError(f"{file}: {exc}{_saved_by(opt, meta.get('optimizer'))}") from exc


def _saved_by(opt, saved):
    """A note for a mismatch when the checkpoint's optimizer class is not this one's. Another class is not
    refused as such: load() takes what this optimizer uses, as load_state_dict() does (an AdamW checkpoint
    loads into OffloadLion, its exp_avg_sq unused; docs/optim.md), and refuses what lacks a field it needs."""
    mine = type(opt).__name__
    return f" (the checkpoint was saved by {saved}; this optimizer is {mine})" \
        if isinstance(saved, str) and saved != mine else ""


def _check_same_parameters(param_groups, saved_groups, file):
    """The saved indices and this optimizer's parameters correspond one to one. A group may hold one parameter
    twice (torch allows it, with a warning): save() then writes its index twice, and the file loads where the
    same places hold one parameter."""
    to_param, to_index = {}, {}
    for g, s in zip(param_groups, saved_groups):
        for p, k in zip(g["params"], s["params"]):
            if to_param.setdefault(k, p) is not p or to_index.setdefault(id(p), k) != k:
                raise ValueError(f"{file}: the 'params' of 'param_groups' must be distinct integers but where this "
                                 f"optimizer's groups hold one parameter twice (index {k} does not match them)")


def _check_groups(opt, groups, file, saved=None):
    """Each saved group's hyperparameters as this optimizer's constructor checks them (its rule's checks),
    and its flags (amsgrad, maximize, ...) bools: ValueError naming the file (and `saved`, the class that saved
    it, where another), before anything changes."""
    for i, g in enumerate(groups):
        for key, default in opt.defaults.items():
            if isinstance(default, bool) and key in g and not isinstance(g[key], bool):
                raise ValueError(f"{file}: param group {i}: {key!r} must be a bool, got {g[key]!r}"
                             f"{_saved_by(opt, saved)}")
        try:
            opt.check_group(g)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{file}: param group {i}: {exc}{_saved_by(opt, saved)}") from None
