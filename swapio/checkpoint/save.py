"""save(state, path): a training state to one safetensors file, through pinned staging and O_DIRECT, committed
atomically (see commit.py, writer.py, layout.py)."""
import os

from ..handle import AioHandle
from . import layout, writer
from .bytes_of import flat_bytes
from .commit import PendingFile
from .structure import flatten

DEFAULT_STAGING = 256 << 20


def new_handle():
    """The handle a checkpoint uses when the caller gives none: 1 MiB requests, 32 in flight per worker, two
    workers (each takes half of a window), O_DIRECT where the file system allows it."""
    return AioHandle(block_size=1 << 20, queue_depth=32, threads=2)


def prepare(state, path, extra_metadata=None):
    """(plan, pending file): everything checked (TypeError for what cannot be stored) before a file exists."""
    skeleton, entries = flatten(state)
    plan = layout.plan(skeleton, entries, extra_metadata)
    return plan, PendingFile(path)


def write_and_commit(plan, pending, pieces, staging, handle=None):
    """Writes the file through staging, then publishes it. On any failure the temporary file is removed."""
    try:
        own = handle is None
        h = new_handle() if own else handle
        try:
            writer.write(h, pending.path, plan.total, pieces, staging, identity=pending.identity)
        except OSError as exc:
            staging.release()  # writer.write waited for every request: the buffers are free
            raise OSError(exc.errno, f"writing the checkpoint {pending.final} failed: "
                                     f"{exc.strerror or exc}", pending.final) from exc
        finally:
            if own:
                h.close()
        staging.release()  # (not after an interruption: a request may still be reading them)
        pending.commit(plan.total)
    finally:
        pending.abort()  # a no-op once committed
    return plan.total


def lazy_pieces(plan):
    """(offset, nbytes, source) of the header and every tensor, each read from the live tensor when reached."""
    pieces = [(0, plan.header.numel(), lambda: plan.header)]
    for offset, i in plan.pieces():
        t = plan.entries[i].tensor
        pieces.append((offset, plan.entries[i].nbytes, lambda t=t: flat_bytes(t)))
    return pieces


def save(state, path, *, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None, distributed=False,
         group=None):
    """Writes `state` to the safetensors file `path`; returns the file's size in bytes. metadata: more {str: str}
    for the header's __metadata__. distributed=True: a collective of `group` (default: the world) where each rank
    saves its own state into the directory `path` (sharded.py)."""
    if distributed:
        from . import sharded
        return sharded.save(state, path, group=group, staging_bytes=staging_bytes, handle=handle)
    plan, pending = prepare(state, os.fspath(path), metadata)
    try:
        staging = writer.Staging(staging_bytes, plan.total)
    except BaseException:
        pending.abort()
        raise
    return write_and_commit(plan, pending, lazy_pieces(plan), staging, handle)
