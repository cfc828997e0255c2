"""save(state, path): a training state to one safetensors file with O_DIRECT, committed atomically (see
commit.py, writer.py, layout.py): big contiguous CPU tensors from their own memory (the file starts with those
whose addresses it can match, layout._congruent_chain), the header and the rest through pinned staging."""
import os

from . import background, buffers, layout, writer
from .bytes_of import flat_bytes
from .commit import PendingFile
from .structure import flatten

DEFAULT_STAGING = 256 << 20


def check_staging_bytes(staging_bytes):
    """staging_bytes must be a positive int (TypeError / ValueError otherwise)."""
    if not isinstance(staging_bytes, int) or isinstance(staging_bytes, bool):
        raise TypeError(f"staging_bytes must be a positive int (bytes), got {type(staging_bytes).__name__} "
                        f"{staging_bytes!r}")
    if staging_bytes <= 0:
        raise ValueError(f"staging_bytes must be a positive int (bytes), got {staging_bytes}")


def prepare(state, path, extra_metadata=None, staging_bytes=DEFAULT_STAGING, placeholders=False):
    """(plan, pending file): everything checked (TypeError for what cannot be stored) before a file exists.
    placeholders: meta tensors stand for bytes a `stream` writes (see write_pending)."""
    check_staging_bytes(staging_bytes)
    skeleton, entries = flatten(state, placeholders)
    for e in entries:  # a lazily conjugated or negated view: its values, one copy of it (its memory holds others)
        if e.tensor.is_conj() or e.tensor.is_neg():
            e.tensor = e.tensor.resolve_conj().resolve_neg()
    plan = layout.plan(skeleton, entries, extra_metadata)
    return plan, PendingFile(path)


DIRECT_MIN = 1 << 20  # contiguous CPU tensors at least this big are written from their own memory


def write_and_commit(plan, pending, pieces, staging, handle=None, direct=(), segments=None):
    """Writes the file (pieces through staging, direct: (offset, bytes) written from the tensors' own memory),
    then publishes it. On any failure the temporary file is removed."""
    try:
        write_pending(plan, pending, pieces, staging, handle, direct, segments)
        commit_pending(pending, plan.total)
    finally:
        pending.abort()  # a no-op once committed
    return plan.total


def write_pending(plan, pending, pieces, staging, handle=None, direct=(), segments=None, stream=None):
    """The bytes of the file into its temporary file, not yet published (swapio.offload.export writes every
    shard before it publishes any); OSError named after the checkpoint. The caller aborts `pending` on failure.
    stream: None, or stream(write) that produces the bytes of the placeholder tensors (flatten's) piece by piece
    from memory it reuses: write(offset, bytes) submits a positional write and returns its future, which stream
    waits before reusing that memory. It runs after the direct writes are submitted and before the staged pieces
    are assembled, so a staged source (the header) may depend on what it streamed (checksums)."""
    try:
        with buffers.handle_for(handle) as h:
            _write(h, pending, plan.total, pieces, staging, direct, segments, stream)
    except OSError as exc:
        staging.release()  # every request was waited for: the buffers are free
        raise OSError(exc.errno, f"writing the checkpoint {pending.final} failed: "
                                 f"{exc.strerror or exc}", pending.final) from exc
    staging.release()  # (not after an interruption: a request may still be reading them)


def commit_pending(pending, size):
    """Publishes a file of `size` bytes written to pending; OSError named after the checkpoint, not the temporary
    file."""
    try:
        pending.commit(size)
    except OSError as exc:  # (nor the rename's pair)
        raise OSError(exc.errno, f"committing the checkpoint {pending.final} failed: {exc.strerror or exc}",
                      pending.final) from exc


def _write(h, pending, total, pieces, staging, direct, segments, stream):
    """The direct requests are all submitted first (the handle copies misaligned memory through its own
    bounce buffers, pipelined with the device), then the stream's, then the staged pieces follow; every request
    is waited for before this returns or raises."""
    futures, error = [], None

    def submit(offset, view):
        return h.pwrite(view, pending.path, offset, identity=pending.identity, staged="auto")

    try:
        for offset, view in direct:
            futures.append(submit(offset, view))
        if stream is not None:
            stream(submit)
        writer.write(h, pending.path, total, pieces, staging, identity=pending.identity, segments=segments)
    except OSError as exc:
        error = exc
    finally:
        error = writer.wait_all(futures, error)
    if error is not None:
        raise error


def split_pieces(plan):
    """(staged pieces at staging positions, segments, direct): big contiguous CPU tensors are written from
    their own memory, the header and the rest through staging (writer.segments_of); placeholders (meta tensors)
    are left to the caller's stream."""
    staged, direct = [(0, plan.header.numel(), lambda: plan.header)], []
    for offset, i in plan.pieces():
        e = plan.entries[i]
        t = e.tensor
        if t.device.type == "meta":
            continue
        if e.nbytes >= DIRECT_MIN and t.device.type == "cpu" and t.is_contiguous():
            direct.append((offset, flat_bytes(t)))
        else:
            staged.append((offset, e.nbytes, lambda t=t: flat_bytes(t)))
    segments, moved = writer.segments_of(staged)
    return moved, segments, direct


def staging_for(segments, staging_bytes):
    """Pinned staging (writer.Staging) for the staged pieces' segments, within staging_bytes."""
    return writer.Staging(staging_bytes, segments[-1][2] + segments[-1][1] - segments[-1][0])


def save(state, path, *, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None, distributed=False,
         group=None):
    """Writes `state` to the safetensors file `path`; returns the file's size in bytes. metadata: more {str: str}
    for the header's __metadata__. distributed=True: a collective of `group` (default: the world) where each rank
    saves its own state into the directory `path` (sharded.py). Saves land in the order they were called: this
    first waits for every async_save queued before it (their errors stay with their futures)."""
    check_staging_bytes(staging_bytes)
    background.wait_all()
    if distributed:
        from . import sharded
        return sharded.save(state, path, group=group, staging_bytes=staging_bytes, handle=handle)
    plan, pending = prepare(state, os.fspath(path), metadata, staging_bytes)
    try:
        pieces, segments, direct = split_pieces(plan)
        staging = staging_for(segments, staging_bytes)
    except BaseException:
        pending.abort()
        raise
    return write_and_commit(plan, pending, pieces, staging, handle, direct, segments)
