"""save_checkpoint(model, path, max_shard_size=None): a model's current weights as a safetensors checkpoint that
transformers' from_pretrained, safetensors and disk_offload(checkpoint=...) read, streamed: one offloaded record
in memory at a time (export_tensors.py), written by swapio.checkpoint's writer through its pinned staging.

Output: one file when path ends in .safetensors (or is no directory and max_shard_size is None); else the layout
save_pretrained writes, model-0000i-of-0000N.safetensors shards of at most max_shard_size bytes of tensors (a
bigger tensor alone in its shard; default 50GB, save_pretrained's) and model.safetensors.index.json.

Crash safety: every file is first written in full under a locked temporary name (checkpoint/commit.py), the shards
and the index alike; only then are they renamed into place, the shards first and the index last, under deferred
Ctrl-C. A failure while writing (a full disk, Ctrl-C, a read error) removes the temporary files and leaves a
previous export untouched; a process killed outright leaves them unlocked, and the next save into that directory
removes them. The old index is removed before the first shard is renamed, so a crash inside the renames
themselves (milliseconds) leaves a directory without an index, which loaders refuse, never a silent mix of two
exports' shards.
"""
import errno
import json
import os
import re

import torch

from ..checkpoint import layout, writer
from ..checkpoint.commit import PendingFile
from ..checkpoint import buffers  # (a module: it imports swapio.offload in turn)
from ..checkpoint.save import DEFAULT_STAGING, commit_pending, write_pending
from ..core import _durable
from .export_tensors import Reader, items
from .registry import offloaded
from .safetensors_format import INDEX, SINGLE
from .streamer import WeightStreamer

SHARD = "model-{:05d}-of-{:05d}.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_SHARD = 50 * 10**9
METADATA = {"format": "pt"}  # what transformers writes, and requires to load a file
_SIZE = re.compile(r"(\d+)\s*(?:([kKmMgGtT])([iI]?)([bB]))?")


def shard_size(value):
    """max_shard_size as transformers takes it: bytes (int), or "5GB" (10^9), "5GiB" (2^30), "5Gb" (gigabits),
    K/M/G/T; ValueError otherwise. (swapio.tools.parse_size reads "5GB" as binary, as fio does: not the same.)"""
    n = 0
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and _SIZE.fullmatch(value.strip()):
        number, unit, binary, b = _SIZE.fullmatch(value.strip()).groups()
        n = int(number)
        if unit:
            power = "KMGT".index(unit.upper()) + 1
            n *= (1 << 10 * power) if binary else 10 ** (3 * power)
            if not binary and b == "b":
                n //= 8
    if n <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB' or '500MB', "
                         f"got {value!r}")
    return n


def _streamer_of(model):
    """The model's WeightStreamer, or None for a model whose weights are its own (not offloaded, or held by
    cpu_offload_with_hook)."""
    owner = offloaded.get(model)
    if not isinstance(owner, WeightStreamer):
        return None
    if owner.model is not model:
        raise ValueError("save_checkpoint needs the model that was offloaded, not one of its submodules")
    return owner


def _shards(stored, limit):
    """The items cut into runs of at most `limit` bytes, in order (huggingface_hub's split)."""
    shards, size = [[]], 0
    for it in stored:
        if shards[-1] and size + it.entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.entry.nbytes
    return shards


def save_checkpoint(model, path, max_shard_size=None):
    """Writes the model's current weights (offloaded by disk_offload or cpu_offload, or a plain nn.Module) as
    safetensors: the file `path`, or the shards and index save_pretrained writes in the directory `path` when it
    is a directory or max_shard_size is given. Ties are stored once, under their first state_dict name. Returns
    the path written (the file, or the index)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    limit = None if max_shard_size is None else shard_size(max_shard_size)
    path = os.path.abspath(os.fspath(path))
    single = path.endswith(".safetensors") or (limit is None and not os.path.isdir(path))
    if single and limit is not None:
        raise ValueError(f"max_shard_size shards the checkpoint into a directory, but {path} names a .safetensors "
                         "file: pass a directory")
    streamer = _streamer_of(model)
    stored = items(model, streamer)
    groups = [stored] if single else _shards(stored, limit or DEFAULT_SHARD)
    finals = [path] if single else [os.path.join(path, SHARD.format(i + 1, len(groups))) for i in range(len(groups))]
    plans = [layout.plain([it.entry for it in g], dict(METADATA)) for g in groups]
    created = not single and not os.path.isdir(path)
    if created:
        try:
            os.mkdir(path)
        except FileExistsError:
            raise OSError(errno.EEXIST, f"cannot write the checkpoint {path}: a file has that name", path) from None
    pendings, done = [], False
    try:
        for final in finals + ([] if single else [os.path.join(path, INDEX)]):
            pendings.append(PendingFile(final))
        _write(streamer, groups, plans, pendings)
        if single:
            commit_pending(pendings[0], plans[0].total)
        else:
            _publish(path, groups, plans, pendings, finals)
        done = True
    finally:
        for p in pendings:
            p.abort()  # a no-op for those committed
        if created and not done:
            _durable.discard(path)  # (only when empty)
    return finals[0] if single else os.path.join(path, INDEX)


def _write(streamer, groups, plans, pendings):
    """Every shard's bytes into its temporary file; offloaded tensors read in file order, across the shards."""
    in_order = [g[i] for g, plan in zip(groups, plans) for _, i in plan.pieces()]
    reader = Reader(streamer, in_order)
    handle = buffers.new_handle()
    try:
        for g, plan, pending in zip(groups, plans, pendings):
            pieces = [(0, plan.header.numel(), lambda h=plan.header: h)]
            pieces += [(offset, g[i].entry.nbytes, reader.source(g[i])) for offset, i in plan.pieces()]
            write_pending(plan, pending, pieces, writer.Staging(DEFAULT_STAGING, plan.total), handle)
    finally:
        reader.release()
        handle.close()


def _publish(directory, groups, plans, pendings, finals):
    """Renames the shards into place, then the index (the commit point); then removes what an earlier export or
    save_pretrained left that loaders would read instead (model.safetensors) or that nothing names any more."""
    index = {"metadata": {"total_size": sum(it.entry.nbytes for g in groups for it in g)},
             "weight_map": {it.entry.name: os.path.basename(f) for g, f in zip(groups, finals) for it in g}}
    data = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    from ..optim.ctrl_c import DeferredSigint  # here: swapio.optim may import swapio.offload at import time
    index_pending = pendings[-1]
    with open(index_pending.path, "wb") as f:
        f.write(data)
    with DeferredSigint():
        if os.path.lexists(index_pending.final):
            os.unlink(index_pending.final)
            _durable.fsync_path(directory, directory=True)
        for plan, pending in zip(plans, pendings):
            commit_pending(pending, plan.total)
        commit_pending(index_pending, len(data))
        keep = {os.path.basename(f) for f in finals}
        for name in os.listdir(directory):
            if (name == SINGLE or _SHARD.fullmatch(name)) and name not in keep:
                _durable.discard(os.path.join(directory, name))
