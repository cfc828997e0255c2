"""save_checkpoint(model, path, max_shard_size=None): a model's current weights as a safetensors checkpoint that
transformers' from_pretrained, safetensors and disk_offload(checkpoint=...) read, streamed: one offloaded record
in memory at a time (export_tensors.py), written by swapio.safetensors' FileWriter through its pinned staging.

Output: one file when path ends in .safetensors (or is no directory and max_shard_size is None); else the layout
save_pretrained writes, model-0000i-of-0000N.safetensors shards of at most max_shard_size bytes of tensors (a
bigger tensor alone in its shard; default 50GB, save_pretrained's) and model.safetensors.index.json.

Crash safety: every file is first written in full under a locked temporary name (swapio/safetensors/commit.py), the shards
and the index alike. A failure while writing (a full disk, Ctrl-C, a read error) removes the temporary files and
leaves a previous export untouched; a process killed outright leaves them unlocked, and the next save into that
directory removes them. Then, under deferred Ctrl-C, the shards are renamed into place under names the current
index does not name (a shard name it names gets a `.swapio-<hex>` tag), and the new index is renamed over the old
one: the commit point. A loader follows the index, so until then it reads the previous export, whole, and after
it the new one. Then the files no index names go (the previous shards, what killed exports left, a
save_pretrained's model.safetensors). Tagged shards are then given their usual names the same way: a second name
(a hard link), a second index commit, and the tagged names removed.
"""
import errno
import json
import numbers
import os
import re
import secrets

import torch

from ..core import _durable
from ..core._errors import check_path
from ..core._signals import DeferredSigint
from ..core.handle import check_moves_data
from ..safetensors import buffers, layout
from ..safetensors.commit import PendingFile, commit_pending
from ..safetensors.file_writer import DEFAULT_STAGING, FileWriter
from ..safetensors.files import INDEX, SINGLE
from ..safetensors.header import MAX_HEADER, strict_json
from .export_tensors import Reader, items
from .hf_model import is_transformers_model
from .registry import offloaded
from .streamer import WeightStreamer
from .units import check_unchanged
from .wrappers import unwrap

SHARD = "model-{:05d}-of-{:05d}.safetensors"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}(?:\.swapio-[0-9a-f]{8})?\.safetensors")  # with the tag of _publish
DEFAULT_SHARD = 50 * 10**9
METADATA = {"format": "pt"}  # what transformers writes, and requires to load a file
_SIZE = re.compile(r"(\d+)\s*(?:([kKmMgGtT])([iI]?)([bB]))?")


def shard_size(value):
    """max_shard_size as transformers takes it: bytes (int), or "5GB" (10^9), "5GiB" (2^30), "5Gb" (gigabits),
    K/M/G/T; ValueError otherwise. (swapio.tools.parse_size reads "5GB" as binary, as fio does: not the same.)"""
    n = 0
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # (numpy's too)
        n = int(value)
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


def _streamer_of(model, part=False):
    """The model's WeightStreamer, or None for a model whose weights are its own (not offloaded, or held by
    cpu_offload_with_hook). part: the model may be a part of the offloaded one."""
    owner = offloaded.get(model)
    if owner is None:
        # a module of the user's own holding an offloaded model (a backbone and a new head): its weights were
        # saved as the stand-ins shown until the model's next forward (NaN), or refused as meta ones after it
        inside = {id(o): o for o in map(offloaded.get, model.modules()) if isinstance(o, WeightStreamer)}
        if len(inside) > 1:
            raise ValueError(f"save_checkpoint saves the weights of one offloaded model, but this module holds "
                             f"{len(inside)} models offloaded by swapio: save each of them with save_checkpoint")
        return next(iter(inside.values()), None)
    if not isinstance(owner, WeightStreamer):
        return None
    if owner.model is not model and not part:
        raise ValueError("save_checkpoint needs the model that was offloaded, not one of its submodules")
    return owner


def _refuse_own_source(streamer, path, single):
    """ValueError when the export would replace or remove a file the model reads its weights from in place (a
    checkpoint given to disk_offload or from_pretrained): the model would then read another export's bytes at its
    old offsets, or fail on a removed shard."""
    if streamer is None:
        return
    for source in {span[0] for record in streamer.records for span in record.spans}:
        directory, name = os.path.split(os.path.realpath(source))
        if single:
            hit = os.path.exists(path) and os.path.samefile(path, source)
        else:
            hit = (name == SINGLE or _SHARD.fullmatch(name)) and os.path.isdir(path) and os.path.samefile(path,
                                                                                                     directory)
        if hit:
            raise ValueError(f"cannot save the checkpoint to {path}: the model reads its weights in place from "
                             f"{source}, which the save would replace. Save to another directory (then load from it), "
                             "or remove_offload(model) first")


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
    is a directory, ends in a slash, or max_shard_size is given. Ties are stored once, under their first
    state_dict name. Returns the path written (the file, or the index)."""
    return write_checkpoint(model, path, max_shard_size)


def write_checkpoint(model, path, max_shard_size=None, relayout=None, part=False):
    """save_checkpoint, the tensors stored as relayout(model, items) says when it is given (save_pretrained's
    original layout, hf_original_layout.py); part: the model may be a part of the offloaded one (the
    transformers model a peft model wraps), its own tensors saved under its own names."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if unwrap(model) is not model:  # torch.compile's wrapper: the plain model's names, as save_pretrained
        model, part = unwrap(model), True
    limit = None if max_shard_size is None else shard_size(max_shard_size)
    given = check_path("path", path)
    check_moves_data(None, "save_checkpoint")  # (its handle's engine="auto", which SWAPIO_ENGINE may make null)
    path = os.path.abspath(given)  # (which drops a trailing slash: "out/" names a directory all the same)
    single = not given.endswith(("/", os.sep)) and (path.endswith(".safetensors") or
                                                     (limit is None and not os.path.isdir(path)))
    if single and limit is not None:
        raise ValueError(f"max_shard_size shards the checkpoint into a directory, but {path} names a .safetensors "
                         "file: pass a directory")
    streamer = _streamer_of(model, part)
    _refuse_own_source(streamer, path, single)
    if streamer is not None:
        streamer.training.settle()  # updates an optimizer still runs from the last backward (in_backward) come first
        check_unchanged(streamer.units)  # a weight replaced, or changed in place and lost, is said, not saved
    stored = items(model, streamer)
    if relayout is not None:
        stored = relayout(model, stored)
    groups = [stored] if single else _shards(stored, limit or DEFAULT_SHARD)
    finals = [path] if single else [os.path.join(path, SHARD.format(i + 1, len(groups))) for i in range(len(groups))]
    plans = [layout.plain([it.entry for it in g], dict(METADATA)) for g in groups]
    created = not single and not os.path.isdir(path)
    if created:
        try:
            os.mkdir(path)
        except FileExistsError:
            raise OSError(errno.EEXIST, f"cannot write the checkpoint {path}: a file has that name", path) from None
    staged = finals if single else _unnamed_by_index(path, finals)
    files, index, done = [], None, False
    try:
        for final, plan in zip(staged, plans):
            files.append(FileWriter(final, plan))
        if not single:
            index = PendingFile(os.path.join(path, INDEX))
        _write(streamer, groups, files)
        if single:
            files[0].commit()
        else:
            _write_configs(model, path)
            _publish(path, groups, files, index, staged, finals)
        done = True
    finally:
        for f in files + ([index] if index is not None else []):
            f.abort()  # a no-op for those committed
        if created and not done:
            _durable.discard(path)  # (only when empty)
    return finals[0] if single else os.path.join(path, INDEX)


def _write_configs(model, directory):
    """A transformers model's config.json (and generation_config.json), as save_pretrained writes them (the dtype
    and class recorded in the config), so that from_pretrained(directory) rebuilds this model; each committed
    like a checkpoint file."""
    if not is_transformers_model(model):
        return
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    files = {"config.json": model.config.to_json_string(use_diff=True)}
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        files["generation_config.json"] = model.generation_config.to_json_string(use_diff=True)
    for name, text in files.items():
        data = text.encode()
        with PendingFile(os.path.join(directory, name)) as pending:
            with open(pending.path, "wb") as f:
                f.write(data)
            commit_pending(pending, len(data))


def _write(streamer, groups, files):
    """Every shard's bytes into its temporary file; offloaded tensors read in file order, across the shards."""
    in_order = [g[i] for g, f in zip(groups, files) for _, i in f.plan.pieces()]
    reader = Reader(streamer, in_order)
    handle = buffers.new_handle()
    try:
        for g, f in zip(groups, files):
            f.write(staging_bytes=DEFAULT_STAGING, handle=handle, source=lambda i, g=g: reader.source(g[i]))
    finally:
        reader.release()
        handle.close()


def _named(directory):
    """The file names the index in directory names (none when it has no index, or one that cannot be read)."""
    path = os.path.join(directory, INDEX)
    try:
        with open(path, "rb") as f:
            weight_map = strict_json(f.read(MAX_HEADER + 1), path).get("weight_map")  # (no RecursionError)
        return {v for v in weight_map.values() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        return set()


def _unnamed_by_index(directory, finals):
    """finals, each shard name the current index names tagged (model-00001-of-00003.swapio-<hex>.safetensors), so
    that no file of the previous export is replaced before the new index is committed."""
    live, tag = _named(directory), secrets.token_hex(4)
    return [f if os.path.basename(f) not in live else f"{f[:-len('.safetensors')]}.swapio-{tag}.safetensors"
            for f in finals]


def _commit_index(pending, groups, names):
    """Writes the index naming `names` (the groups' files) to pending and renames it into place."""
    index = {"metadata": {"total_size": sum(it.entry.nbytes for g in groups for it in g)},
             "weight_map": {it.entry.name: os.path.basename(f) for g, f in zip(groups, names) for it in g}}
    data = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    with open(pending.path, "wb") as f:
        f.write(data)
    commit_pending(pending, len(data))


def _remove_unnamed(directory, names):
    """Removes the checkpoint files (model.safetensors, shards) in directory that `names` does not hold: an
    earlier export's, what killed ones left, a save_pretrained's that loaders would read instead of the index."""
    keep = {os.path.basename(f) for f in names}
    for name in os.listdir(directory):
        if (name == SINGLE or _SHARD.fullmatch(name)) and name not in keep:
            _durable.discard(os.path.join(directory, name))


def _publish(directory, groups, files, index, staged, finals):
    """Renames the shards into place under their staged names, then the index naming them (the commit point); then
    removes the files no index names, and gives tagged shards their usual names (see the module)."""
    with DeferredSigint():
        for f in files:
            f.commit()
        _commit_index(index, groups, staged)
        _remove_unnamed(directory, staged)
        if staged == finals:
            return
        try:
            for tagged, final in zip(staged, finals):
                if tagged != final:
                    os.link(tagged, final)  # (no file has that name: the previous export's just went)
        except OSError:  # a file system without hard links: the tagged names stay, which loaders follow
            _remove_unnamed(directory, staged)
            return
        _durable.fsync_path(directory, directory=True)
        with PendingFile(os.path.join(directory, INDEX)) as second:
            _commit_index(second, groups, finals)
        _remove_unnamed(directory, finals)
