"""Streaming, atomic checkpoints of the offloaded optimizers (opt.save(dir) / opt.load(dir)).

A checkpoint is a directory holding two files:
  swapio-optim.pt               metadata (torch.save, loaded with weights_only=True): format, version, the
                                optimizer class, its state_dtype (version 3), param_groups as in state_dict(),
                                per parameter index its step, shape, dtype and the byte offset of each array in
                                the data file, and an xxh3-64 checksum of each array (version 2)
  swapio-optim-<token>.bin      the arrays as the optimizer stores them (swapio.optim.state_format): exp_avg,
                                exp_avg_sq, max_exp_avg_sq (amsgrad), master (bf16/fp16 parameters only), the
                                int8 scales; each parameter's fields one after the other, each 4 KiB aligned
The data go to "<name>.bin.tmp", are fsynced and renamed; then the metadata go to a temporary name, are fsynced
and renamed over swapio-optim.pt (the commit point) and the directory is fsynced. A crash or a signal at any
moment leaves either the previous checkpoint or the new one under swapio-optim.pt: once the rename is done,
nothing the new metadata names is ever deleted, whatever fails after it. A save holds the directory's flock
(swapio.optim.dir_lock) exclusively, a load shared: a save while another live process saves or loads there
raises OSError(EBUSY), and a save that holds it removes what earlier saves left behind (data files no metadata
names, temporary data and metadata files of saves that were killed).

load() is all or nothing: it validates the metadata, reads every array into new storage (new tensors in cpu
mode, a new swap file in nvme mode: the disk briefly holds both), verifies the checksums, and only then swaps
the new state in; a failure at any point leaves the optimizer exactly as it was.

The arrays stream chunk by chunk through the optimizer's pinned buffers (nvme mode) or straight from/to the
state tensors (cpu mode), so saving or loading never holds more than a chunk beyond the live state. A checkpoint
from either mode loads into either mode; the layout does not depend on buffer sizes. A checkpoint of another
state_dtype loads too: its moments are decoded to fp32 and stored in this optimizer's format.
"""
import contextlib
import errno
import os
import secrets

import torch

from .. import _progress
from ..core import _checksum, _durable
from ..core._align import round_up
from . import dir_lock, state_transfer, validate
from .params import shard
from .state_format import SCALE, StateFormat

META = "swapio-optim.pt"
META_TMP_PREFIX = f".{META}."  # + <hex>.tmp: metadata being written
DATA_PREFIX = "swapio-optim-"
DATA_SUFFIX = ".bin"
FORMAT = "swapio.optim.checkpoint"
VERSION = 3  # 2: checksums; 3: state_dtype (bf16/int8 arrays)


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


def _save(opt, path, progress=False):
    groups, index = state_transfer.pack_groups(opt.param_groups)
    fields_of = opt.exported_fields()
    fmt = opt.state_format
    stateful, seen, entries, offsets = [], set(), {}, {}
    end = payload = 0  # payload: the arrays' bytes without the alignment padding, what the bar counts
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st or id(p) in seen:
                continue
            seen.add(id(p))
            stateful.append(p)
            t, offs = shard(p), {}
            for name in fields_of[p]:
                offs[name] = end
                nbytes = fmt.count(name, t.numel()) * fmt.dtype(name).itemsize
                payload += nbytes
                end += round_up(nbytes)
            offsets[p] = offs
            entries[index[id(p)]] = {"step": st["step"].detach().clone(), "shape": tuple(t.shape),
                                     "numel": t.numel(), "dtype": str(t.dtype).replace("torch.", ""),
                                     "fields": dict(offs)}
    data_name = f"{DATA_PREFIX}{secrets.token_hex(8)}{DATA_SUFFIX}"
    data_path = os.path.join(path, data_name)
    tmp_data = data_path + ".tmp"
    fd = os.open(tmp_data, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.ftruncate(fd, end)
    finally:
        os.close(fd)
    tmp_meta = os.path.join(path, f"{META_TMP_PREFIX}{secrets.token_hex(4)}.tmp")
    meta_path = os.path.join(path, META)
    sums = {}
    bar = _bar(progress, payload, "swapio: saving optimizer")
    try:
        with state_transfer.io_handles(opt) as (_, wh):
            def sink(p, a, b, views):
                futures = []
                for name, off in offsets[p].items():
                    view, first = views[name], fmt.first(name, a)
                    sums.setdefault(p, {}).setdefault(name, _checksum.Stream()).update(first, view)
                    futures.append(wh.pwrite(view, tmp_data, off + first * view.element_size()))
                    if bar is not None:  # written when the future finishes; queued now, close enough to watch
                        bar.update(view.nbytes)
                return futures

            opt.read_state(stateful, sink)
            wh.wait()
        for p, offs in offsets.items():
            entries[index[id(p)]]["checksums"] = {name: sums[p][name].intdigest() if name in sums.get(p, {})
                                                  else _checksum.Stream().intdigest() for name in offs}
        meta = {"format": FORMAT, "version": VERSION, "optimizer": type(opt).__name__, "state_dtype": fmt.name,
                "param_groups": groups, "state": entries, "data": data_name, "data_bytes": end,
                "checksum": _checksum.ALGORITHM}
    except BaseException:
        _durable.discard(tmp_data)
        raise
    finally:
        if bar is not None:
            bar.close()
    _durable.commit_data_and_index(tmp_data, data_path, tmp_meta, meta_path, lambda f: torch.save(meta, f))
    # Data of earlier checkpoints, and whatever interrupted saves left (this save holds the directory's lock, so
    # no other save is under way: their temporary files are leftovers).
    _durable.remove_others(path, DATA_PREFIX, (DATA_SUFFIX, DATA_SUFFIX + ".tmp"), keep=data_name)
    _durable.remove_others(path, META_TMP_PREFIX, (".tmp",), keep=None)


def read_meta(path):
    """The checkpoint's metadata, validated (swapio.optim.validate): ValueError naming the first problem."""
    meta_path = os.path.join(os.fspath(path), META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path}: no swapio optimizer checkpoint ({META} is missing)")
    try:
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler makes of a damaged file
        raise ValueError(f"{meta_path} is not a readable swapio optimizer checkpoint: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a swapio optimizer checkpoint")
    validate.checkpoint_meta(meta, meta_path, VERSION, _checksum.ALGORITHM)
    return meta


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
    size = os.path.getsize(data_path) if os.path.exists(data_path) else -1
    if size < meta["data_bytes"]:
        raise ValueError(f"{data_path}: {'missing' if size < 0 else f'{size} bytes'}; the checkpoint needs "
                         f"{meta['data_bytes']} bytes")
    id_map, new_groups = state_transfer.remap_groups(opt.param_groups, meta["param_groups"])
    steps, fields, offsets, expected = {}, {}, {}, {}
    for k, entry in meta["state"].items():
        p = id_map[k]
        t = shard(p)
        if tuple(entry["shape"]) != tuple(t.shape):
            raise ValueError(f"{path}: parameter {k} has shape {tuple(t.shape)}; its checkpointed state is for "
                             f"shape {tuple(entry['shape'])}")
        saved_dtype = entry.get("dtype", "float32")
        if opt.is_offloaded(p) and saved_dtype != str(t.dtype).replace("torch.", ""):
            # its weights are rewritten from the loaded master in the offload storage's dtype: a checkpoint of
            # another model (a resident parameter may change dtype between runs, as with torch)
            raise ValueError(f"{path}: parameter {k} is an offloaded weight of dtype {t.dtype}; its checkpointed "
                             f"state is for a weight of dtype {saved_dtype}")
        steps[p] = validate.step_count(entry["step"], f"{path}: parameter {k}")
        fields[p] = {name for name in entry["fields"] if not saved_fmt.is_scale(name)}
        offsets[p] = entry["fields"]
        expected[p] = (k, entry.get("checksums"))
    sums, bad = {}, []
    # the bar counts the bytes read; a field this optimizer does not keep is not read, so it may stop short
    total = sum(saved_fmt.count(name, entry["numel"]) * saved_fmt.dtype(name).itemsize
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

        state_transfer.install(opt, new_groups, steps, fields, source, check=check)
