"""torch.distributed: each rank saves its own state to path/rank-{r}.safetensors, then rank 0 writes
path/swapio-checkpoint.json (format, world size, a save id, the rank files). Loading needs the same world size:
resharding is out of scope, and another world size is a ValueError saying so.

Every rank writes its temporary file, and renames it over the previous one (atomically) only once every rank has
written its own, so one rank's error or death while writing leaves the previous checkpoint whole; the index is
written last, after every rank reported its commit, and also atomically. Each rank file carries the save id in its
__metadata__, so a set of files from two different saves (a job killed while the ranks were renaming, before the
index was written) is refused at load with a ValueError instead of being loaded as a mix.
"""
import json
import os
import secrets

from ..core import _durable
from ..safetensors.header import MAX_HEADER, strict_json
from ..safetensors.opened import open_checkpoint
from ..safetensors.file_writer import DEFAULT_STAGING, FileWriter
from .format import plan_state
from .load import read_state

INDEX = "swapio-checkpoint.json"
FORMAT = "swapio.checkpoint.sharded"
META_RANK, META_WORLD, META_SAVE_ID = "swapio.rank", "swapio.world_size", "swapio.save_id"


def rank_file(path, rank):
    return os.path.join(path, f"rank-{rank}.safetensors")


def is_sharded(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX))


def _group_info(group):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("swapio.checkpoint.save(..., distributed=True) needs an initialised torch.distributed "
                           "process group")
    return dist, dist.get_rank(group), dist.get_world_size(group)


def save(state, path, *, group=None, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None):
    """Collective: every rank of `group` calls it with its own state. Two phases: every rank writes its temporary
    file, and only once all have does any rank rename its own over the previous one, so that one rank's error (or
    death) while writing leaves every rank's previous file, and the checkpoint, as they were."""
    dist, rank, world = _group_info(group)
    path = os.path.abspath(os.fspath(path))
    token = [secrets.token_hex(8) if rank == 0 else None]
    # src is a global rank: the group's rank 0 (a group need not hold global rank 0)
    dist.broadcast_object_list(token, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    writer, error = None, None
    try:
        try:
            os.makedirs(path, exist_ok=True)
            plan = plan_state(state, _rank_metadata(metadata, rank, world, token[0]))
            writer = FileWriter(rank_file(path, rank), plan)
            writer.write(staging_bytes=staging_bytes, handle=handle)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree raises it)
            error = exc
        _agree(dist, group, world, error, "failed to save its shard", "no rank file was replaced")
        try:
            size = writer.commit()
        except Exception as exc:  # noqa: BLE001
            error = exc
        _agree(dist, group, world, error, "failed to commit its shard", f"the index {os.path.join(path, INDEX)} "
               "was not updated")
    finally:
        if writer is not None:
            writer.abort()  # (a no-op once committed)
    if rank == 0:
        index = {"format": FORMAT, "world_size": world, "save_id": token[0],
                 "files": [os.path.basename(rank_file(path, r)) for r in range(world)]}
        try:
            _durable.write_and_replace(os.path.join(path, f".{INDEX}.{token[0]}.tmp"), os.path.join(path, INDEX),
                                       lambda f: json.dump(index, f), mode="w")
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for the index: tell them, then raise it
            error = exc
    # (not a barrier: a rank 0 that failed here would leave the others waiting, or returning as if saved)
    _agree(dist, group, world, error, "failed to write the index", "the rank files are committed but the index is "
           "the previous save's: the directory does not load until the next complete save")
    return size


def _rank_metadata(metadata, rank, world, save_id):
    """The caller's metadata= and this module's keys, which the caller may not set (load trusts them)."""
    metadata = dict(metadata or {})
    own = {META_RANK: str(rank), META_WORLD: str(world), META_SAVE_ID: save_id}
    reserved = sorted(set(metadata) & set(own))
    if reserved:
        raise ValueError(f"metadata key {reserved[0]!r} is reserved: a distributed save writes {sorted(own)} itself; "
                         "use another key")
    return {**metadata, **own}


def _agree(dist, group, world, error, failed, consequence):
    """Every rank learns whether any failed: raises this rank's own error, else a RuntimeError naming the first
    rank that failed (all_gather_object: each rank's error as text, None for success)."""
    outcomes = [None] * world
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    for r, e in enumerate(outcomes):
        if e is not None:
            raise RuntimeError(f"swapio.checkpoint: rank {r} {failed} ({e}); {consequence}")


def load(path, *, group=None, **kwargs):
    """This rank's state from a sharded checkpoint saved by the same number of ranks (kwargs: read_state's)."""
    index_path = os.path.join(path, INDEX)
    with open(index_path, "rb") as f:
        index = strict_json(f.read(MAX_HEADER + 1), index_path)  # from outside: no RecursionError, no duplicates
    try:
        world_saved, save_id = index["world_size"], str(index["save_id"])
        if index.get("format") != FORMAT or type(world_saved) is not int:  # (not 1.7 read as 1, nor true)
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{index_path}: not a swapio sharded checkpoint index") from None
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized()
    except ImportError:
        distributed = False
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    if world != world_saved:
        raise ValueError(f"{path} was saved by {world_saved} ranks and this job has {world}: loading it on another "
                         "world size (resharding) is out of scope for swapio.checkpoint; load it with the same "
                         "number of ranks")
    file = rank_file(path, rank)
    if not os.path.isfile(file):
        raise ValueError(f"{index_path} names {file}, which does not exist")
    opened = open_checkpoint(file)
    got = opened.metadata.get(META_SAVE_ID)
    if got != save_id:
        raise ValueError(f"{file} belongs to another save ({got}) than the index {index_path} ({save_id}): a sharded "
                         "save was interrupted after some ranks replaced their files; this checkpoint is a mix")
    return read_state(opened, **kwargs)
