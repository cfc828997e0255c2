"""Streaming, atomic checkpoints of OffloadAdam/OffloadAdamW (opt.save(dir) / opt.load(dir)).

A checkpoint is a directory holding two files:
  swapio-optim.pt               metadata (torch.save, loaded with weights_only=True): format, version, the
                                optimizer class, param_groups as in state_dict(), and per parameter index its
                                step, shape, dtype and the byte offset of each fp32 array in the data file
  swapio-optim-<token>.bin      the arrays: exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad), master (bf16/fp16
                                parameters only), each parameter's fields one after the other, each 4 KiB aligned
The data go to "<name>.bin.tmp", are fsynced and renamed; then the metadata go to a temporary name, are fsynced
and renamed over swapio-optim.pt (the commit point) and the directory is fsynced. A crash at any moment leaves
either the previous checkpoint or the new one under swapio-optim.pt; data files no metadata names are removed
by the next save. One writer per directory at a time.

The arrays stream chunk by chunk through the optimizer's pinned buffers (nvme mode) or straight from/to the
state tensors (cpu mode), so saving or loading never holds more than a chunk beyond the live state. A checkpoint
from either mode loads into either mode; the layout does not depend on buffer sizes.
"""
import os
import secrets

import torch

META = "swapio-optim.pt"
DATA_PREFIX = "swapio-optim-"
DATA_SUFFIX = ".bin"
FORMAT = "swapio.optim.checkpoint"
VERSION = 1
_ALIGN = 4096


def _fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _round_up(x):
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


def save(opt, path):
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    groups, index = opt._pack_groups()
    fields_of = opt._fields_of()
    stateful, seen, entries, offsets = [], set(), {}, {}
    end = 0
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st or id(p) in seen:
                continue
            seen.add(id(p))
            stateful.append(p)
            offs = {}
            for name in fields_of(p):
                offs[name] = end
                end += _round_up(p.numel() * 4)
            offsets[p] = offs
            entries[index[id(p)]] = {"step": st["step"].detach().clone(), "shape": tuple(p.shape),
                                     "numel": p.numel(), "dtype": str(p.dtype).replace("torch.", ""),
                                     "fields": dict(offs)}
    data_name = f"{DATA_PREFIX}{secrets.token_hex(8)}{DATA_SUFFIX}"
    data_path = os.path.join(path, data_name)
    tmp_data = data_path + ".tmp"
    fd = os.open(tmp_data, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.ftruncate(fd, end)
    finally:
        os.close(fd)
    tmp_meta = os.path.join(path, f".{META}.{secrets.token_hex(4)}.tmp")
    try:
        rh, wh, owned = opt._io_handle()
        try:
            def sink(p, name, a, view):
                return wh.pwrite(view, tmp_data, offsets[p][name] + 4 * a)

            opt._backend.dump(stateful, fields_of, sink)
            wh.wait()
        finally:
            if owned:
                rh.close()
                if wh is not rh:
                    wh.close()
        _fsync_path(tmp_data)
        os.rename(tmp_data, data_path)
        _fsync_path(path, directory=True)
        meta = {"format": FORMAT, "version": VERSION, "optimizer": type(opt).__name__, "param_groups": groups,
                "state": entries, "data": data_name, "data_bytes": end}
        with open(tmp_meta, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_meta, os.path.join(path, META))
        _fsync_path(path, directory=True)
    except BaseException:
        for leftover in (tmp_data, tmp_meta, data_path):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        raise
    for name in os.listdir(path):  # data of earlier checkpoints and of interrupted saves
        if name != data_name and name.startswith(DATA_PREFIX) and (name.endswith(DATA_SUFFIX)
                                                                     or name.endswith(DATA_SUFFIX + ".tmp")):
            try:
                os.unlink(os.path.join(path, name))
            except FileNotFoundError:
                pass


def read_meta(path):
    meta_path = os.path.join(os.fspath(path), META)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{path}: no swapio optimizer checkpoint ({META} is missing)")
    meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a swapio optimizer checkpoint")
    if meta.get("version", 0) > VERSION:
        raise ValueError(f"{meta_path} has format version {meta['version']}; this swapio reads up to {VERSION}")
    return meta


def load(opt, path):
    path = os.fspath(path)
    meta = read_meta(path)
    data_path = os.path.join(path, meta["data"])
    size = os.path.getsize(data_path) if os.path.exists(data_path) else -1
    if size < meta["data_bytes"]:
        raise ValueError(f"{data_path}: {'missing' if size < 0 else f'{size} bytes'}; the checkpoint needs "
                         f"{meta['data_bytes']} bytes")
    id_map, new_groups = opt._remap_groups(meta["param_groups"])
    steps, fields, offsets = {}, {}, {}
    for k, entry in meta["state"].items():
        p = id_map.get(k)
        if p is None:
            continue
        if entry["numel"] != p.numel():
            raise ValueError(f"parameter {k} has {p.numel()} elements; its checkpointed state has {entry['numel']}")
        steps[p] = entry["step"].to(torch.float32).reshape(()).clone()
        fields[p] = set(entry["fields"])
        offsets[p] = entry["fields"]
    rh, wh, owned = opt._io_handle()
    try:
        def source(p, name, a, view):
            return rh.pread(view, data_path, offsets[p][name] + 4 * a)

        opt._install(new_groups, steps, fields, source)
    finally:
        if owned:
            rh.close()
            if wh is not rh:
                wh.close()
