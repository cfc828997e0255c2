"""Loading an optimizer's checkpoint, all or nothing, whatever its version (read_meta gives one form): the saved
groups and parameters checked against this optimizer, every array read into new storage (new tensors in cpu
mode, a new swap file in nvme mode: the disk briefly holds both), its checksum verified, and only then the new
state swapped in (state_transfer.install); a failure at any point leaves the optimizer exactly as it was. A
checkpoint from either mode loads into either mode; one of another state_dtype loads too (its moments decoded to
fp32 and stored in this optimizer's format)."""
import os

import torch

from ... import _progress
from ...core import _checksum
from ...core._in_flight import InFlight
from .. import state_transfer, unstepped_weights, validate
from ..params import shard
from ..state_format import SCALE, StateFormat
from .files import regular


def restore(opt, meta, path, progress=False):
    """Reads the arrays of the checkpoint in the directory `path` (meta: read_meta's) into new storage, checks
    them, then swaps them in (see the module); ValueError naming the file, the optimizer left as it was."""
    saved_fmt = StateFormat(meta.get("state_dtype", "fp32"))
    fmt = opt.state_format
    data_path = os.path.join(path, meta["data"])
    size = os.path.getsize(data_path) if regular(data_path) else -1
    if size < meta["data_bytes"]:
        raise ValueError(f"{data_path}: {'missing' if size < 0 else f'{size} bytes'}; the checkpoint needs "
                         f"{meta['data_bytes']} bytes")
    file = meta["file"]
    try:
        id_map, new_groups = state_transfer.remap_groups(opt.param_groups, meta["param_groups"])
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}{_saved_by(opt, meta.get('optimizer'))}") from None
    _check_same_parameters(opt.param_groups, meta["param_groups"], file)
    check_groups(opt, new_groups, file, meta.get("optimizer"))
    unstepped_weights.check(opt, id_map, meta.get(unstepped_weights.KEY, {}), file)
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
    with _progress.byte_bar(progress, total, "swapio: loading optimizer") as bar, \
            state_transfer.io_handles(opt) as (rh, _):
        in_flight = InFlight()

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

            return in_flight.submit(
                lambda: rh.pread(view, data_path, offsets[p][name] + first * view.element_size())._chain(arrived))

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


def check_groups(opt, groups, file, saved=None):
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
