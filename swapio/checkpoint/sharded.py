"""torch.distributed: each rank saves its own state to a file of its own in the directory path, and rank 0 the
index path/swapio-checkpoint.json naming them (sharded_index.py). Loading needs the same world size: resharding is
out of scope, and another world size is a ValueError saying so.

A save commits once, for all ranks, so that a kill at any point (SIGKILL, OOM, a node lost) leaves the previous
checkpoint or the new one, whole, never a mix and never an unloadable directory:
0. rank 0 takes the directory's flock (core/_dir_lock.py) and holds it to the end, after every rank's step 4:
   another job saving into the directory meanwhile is refused (EBUSY) before any of its ranks writes, instead
   of each job removing the other's files as stale (where the file system has no flock, one job at a time is
   the caller's to ensure);
1. every rank writes its file under a name of this save's own (its save id, which rank 0 draws), published
   atomically; the committed checkpoint's files are not touched;
2. the ranks agree that every one wrote its file;
3. rank 0 renames the new index over the old one (fsynced, the directory fsynced): the commit point;
4. the ranks agree that it did, then each removes the files of its rank the new index does not name (earlier and
   interrupted saves'), rank 0 those of ranks beyond the world size and the index's temporary files.
Loading follows the committed index only. Each rank file also carries the save id, its rank and the world size in
its __metadata__, so a file copied in from another save or another rank under a valid name, or an index edited to
another world size, is refused instead of loaded as a mix.

An agreement carries each rank's failure: a rank that fails, or is interrupted (Ctrl-C), before it sends its part
tells the others, which raise a RuntimeError naming it at once instead of waiting out the group's timeout; then
every rank removes its file of this save (unless rank 0 committed the index naming it). An interruption that lands
inside a collective itself leaves the others waiting (torch.distributed cannot take back half a collective).
"""
import contextlib
import os

from ..core import _dir_lock, _durable
from ..safetensors.file_writer import DEFAULT_STAGING, FileWriter
from ..safetensors.opened import open_checkpoint
from . import sharded_index
from .format import plan_state
from .load import read_state
from .sharded_index import INDEX

META_RANK, META_WORLD, META_SAVE_ID = "swapio.rank", "swapio.world_size", "swapio.save_id"
is_sharded = sharded_index.exists


def _group_info(group):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("swapio.checkpoint.save(..., distributed=True) needs an initialised torch.distributed "
                           "process group")
    return dist, dist.get_rank(group), dist.get_world_size(group)


def save(state, path, *, group=None, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None):
    """Collective: every rank of `group` calls it with its own state; returns the size of this rank's file. The
    commit protocol is the module's; rank 0 holds the directory's lock from before any rank writes until every
    rank has removed its stale files, so that another job saving there meanwhile is refused (EBUSY) instead of
    each removing the other's files."""
    dist, rank, world = _group_info(group)
    path = os.path.abspath(os.fspath(path))
    with contextlib.ExitStack() as held:
        token, error = [None, None], None
        if rank == 0:
            try:
                os.makedirs(path, exist_ok=True)
                held.enter_context(_dir_lock.locked(path, exclusive=True, what="distributed checkpoint directory"))
                token[0] = sharded_index.new_save_id()
            except BaseException as exc:  # noqa: BLE001 - the other ranks must not start: tell them, then raise it
                token[1], error = _describe(exc), exc
        # src is a global rank: the group's rank 0 (a group need not hold global rank 0)
        dist.broadcast_object_list(token, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        if error is not None:
            raise error
        if token[1] is not None:
            raise RuntimeError(f"swapio.checkpoint: rank 0 failed to start the save ({token[1]}); the checkpoint "
                               "is the previous save's")
        return _save(dist, group, rank, world, token[0], state, path, staging_bytes, handle, metadata)


def _save(dist, group, rank, world, save_id, state, path, staging_bytes, handle, metadata):
    name = sharded_index.rank_file_name(rank, save_id)
    own, size, error = os.path.join(path, name), None, None
    try:
        os.makedirs(path, exist_ok=True)
        plan = plan_state(state, _rank_metadata(metadata, rank, world, save_id))
        with FileWriter(own, plan) as writer:  # (leaving it uncommitted removes its temporary file)
            writer.write(staging_bytes=staging_bytes, handle=handle)
            size = writer.commit()
    except BaseException as exc:  # noqa: BLE001 - every rank must learn of it, Ctrl-C included (_agree raises it)
        error = exc
    try:
        _agree(dist, group, world, error, "failed to save its shard", lambda: "the checkpoint is the previous save's")
    except BaseException:
        _durable.discard(own)  # no index names it
        raise
    if rank == 0:
        try:
            sharded_index.commit(path, world, save_id)
        except BaseException as exc:  # noqa: BLE001 - the other ranks wait for the index: tell them, then raise it
            error = exc
    # (not a barrier: a rank 0 that failed here would leave the others waiting, or returning as if saved)
    try:
        _agree(dist, group, world, error, "failed to write the index",
               lambda: _outcome(path, save_id, os.path.join(path, INDEX)))
    except BaseException:
        # the index may be this save's all the same (rank 0 interrupted after its rename): ask the file system
        if sharded_index.committed_save_id(path) == save_id:
            _remove_stale(path, name, rank, world)
        else:
            _durable.discard(own)
        raise
    try:
        _remove_stale(path, name, rank, world)
    except BaseException as exc:  # noqa: BLE001 - (Ctrl-C) the others must not wait for this rank: tell them
        error = exc
    # every rank done removing before rank 0 lets go of the lock; the save is committed: each raises only its own
    dist.all_gather_object([None] * world, None, group=group)
    if error is not None:
        raise error
    return size


def _remove_stale(path, name, rank, world):
    """Once this save is committed: the files of this rank but its own (name), and rank 0's share of the rest."""
    sharded_index.remove_stale(path, {name}, lambda r: r == rank or (rank == 0 and r >= world),
                               index_temps=rank == 0)


def _outcome(path, save_id, index_path):
    if sharded_index.committed_save_id(path) == save_id:
        return f"{index_path} names this save all the same: the new checkpoint is committed"
    return f"{index_path} is the previous save's: the checkpoint is the previous save's"


def _rank_metadata(metadata, rank, world, save_id):
    """The caller's metadata= and this module's keys, which the caller may not set (load trusts them)."""
    metadata = dict(metadata or {})
    own = {META_RANK: str(rank), META_WORLD: str(world), META_SAVE_ID: save_id}
    reserved = sorted(set(metadata) & set(own))
    if reserved:
        raise ValueError(f"metadata key {reserved[0]!r} is reserved: a distributed save writes {sorted(own)} itself; "
                         "use another key")
    return {**metadata, **own}


def _describe(error):
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _agree(dist, group, world, error, failed, consequence):
    """Every rank learns whether any failed: raises this rank's own error, else a RuntimeError naming the first
    rank that failed and consequence() (all_gather_object: each rank's error as text, None for success)."""
    outcomes = [None] * world
    dist.all_gather_object(outcomes, None if error is None else _describe(error), group=group)
    if error is not None:
        raise error
    for r, e in enumerate(outcomes):
        if e is not None:
            raise RuntimeError(f"swapio.checkpoint: rank {r} {failed} ({e}); {consequence()}")


def load(path, *, group=None, **kwargs):
    """This rank's state from a sharded checkpoint saved by the same number of ranks (kwargs: read_state's)."""
    index = sharded_index.Index(path)
    try:
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized()
    except ImportError:
        distributed = False
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    if world != index.world_size:
        raise ValueError(f"{index.path}: saved by {index.world_size} ranks and this job has {world}: loading it "
                         "on another world size (resharding) is out of scope for swapio.checkpoint; load it with the "
                         "same number of ranks")
    file = index.file_of(rank)
    opened = open_checkpoint(file)
    got = opened.metadata.get(META_SAVE_ID)
    if got != index.save_id:
        raise ValueError(f"{file} belongs to another save ({got}) than the index {index.path} ({index.save_id}): "
                         "a file copied in from another save, or a version-1 checkpoint whose save was interrupted "
                         "after some ranks replaced their files; this checkpoint is a mix")
    saved = (opened.metadata.get(META_RANK), opened.metadata.get(META_WORLD))
    if saved != (str(rank), str(world)):
        raise ValueError(f"{file} holds rank {str(saved[0])[:20]}'s state of a save by {str(saved[1])[:20]} ranks, "
                         f"where the index {index.path} names it for rank {rank} of {world}: a file copied in "
                         "under another rank's name, or an index edited; refused")
    return read_state(opened, **kwargs)
