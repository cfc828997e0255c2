"""torch.distributed: each rank saves its own state to path/rank-{r}.safetensors, then rank 0 writes
path/swapio-checkpoint.json (format, world size, a save id, the rank files). Loading needs the same world size:
resharding is out of scope, and another world size is a ValueError saying so.

Every rank file is committed atomically on its own (save()); the index is written last, after every rank
reported success, and also atomically. Each rank file carries the save id in its __metadata__, so a set of files
from two different saves (a job killed after some ranks replaced their files but before the index was written)
is refused at load with a ValueError instead of being loaded as a mix.
"""
import json
import os
import secrets

from ..core import _durable
from ..safetensors.header import MAX_HEADER, strict_json
from ..safetensors.opened import open_checkpoint
from .load import read_state
from .save import save_file

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


def save(state, path, *, group=None, **kwargs):
    """Collective: every rank of `group` calls it with its own state (kwargs: save_file's)."""
    dist, rank, world = _group_info(group)
    path = os.path.abspath(os.fspath(path))
    token = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=None if group is None else group)
    error = None
    try:
        os.makedirs(path, exist_ok=True)
        size = save_file(state, rank_file(path, rank), metadata={META_RANK: str(rank), META_WORLD: str(world),
                                                                 META_SAVE_ID: token[0]}, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (raised below, after the exchange)
        error, size = exc, -1
    outcomes = [None] * world
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        raise RuntimeError(f"swapio.checkpoint: rank {failed[0][0]} failed to save its shard ({failed[0][1]}); "
                           f"the index {os.path.join(path, INDEX)} was not updated")
    if rank == 0:
        index = {"format": FORMAT, "world_size": world, "save_id": token[0],
                 "files": [os.path.basename(rank_file(path, r)) for r in range(world)]}
        _durable.write_and_replace(os.path.join(path, f".{INDEX}.{token[0]}.tmp"), os.path.join(path, INDEX),
                                   lambda f: json.dump(index, f), mode="w")
    dist.barrier(group=group)
    return size


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
