"""FileWriter: one safetensors file from its Plan to its commit, the way every such file swapio writes goes
(swapio.checkpoint's save and async_save, the optimizers' checkpoints, swapio.offload's save_checkpoint):

    with FileWriter(path, layout.plan(entries, metadata)) as f:   # a locked temporary file beside path
        f.write(staging_bytes=..., handle=...)                     # the bytes, streamed (writer.py)
        f.commit()                                                 # truncate, fsync, rename over path
    # leaving the block without commit() removes the temporary file (commit.py)

write() splits the plan: the header and the small or non-contiguous tensors go through pinned staging windows,
big contiguous CPU tensors as positional O_DIRECT writes from their own memory, and meta tensors (placeholders)
are left to `stream`, which writes their bytes itself from memory it reuses (the optimizers stream their state
from their own buffers). With `source` the caller gives every tensor's bytes instead, all staged (save_checkpoint
reads offloaded weights through the model's fetcher). A file whose bytes were captured already (async_save's image)
goes through write_pieces.
"""
from ..core._in_flight import InFlight
from . import buffers, writer
from .bytes_of import flat_bytes
from .commit import PendingFile, commit_pending
from .files import WrittenInPlace

DEFAULT_STAGING = 256 << 20
DIRECT_MIN = 1 << 20  # contiguous CPU tensors at least this big are written from their own memory


class FileWriter:
    """A safetensors file on its way to `path` (plan: layout.Plan, its header and every tensor's offset)."""

    def __init__(self, path, plan):
        self.plan = plan
        self.pending = PendingFile(path)

    @property
    def path(self):
        """The final path (the file appears there at commit())."""
        return self.pending.final

    def write(self, *, staging_bytes=DEFAULT_STAGING, handle=None, source=None, stream=None):
        """Writes the whole file to its temporary file within staging_bytes of pinned staging (see the module).
        source: None (the plan's own tensors), or source(entry index) -> a callable returning that entry's bytes
        as a 1-D uint8 tensor (writer.py's sources). stream: see write_pieces. OSError named after the file."""
        pieces, segments, direct = split_pieces(self.plan, source)
        staging = writer.Staging(staging_bytes, segments[-1][2] + segments[-1][1] - segments[-1][0])
        self.write_pieces(pieces, staging, handle=handle, direct=direct, segments=segments, stream=stream)

    def write_pieces(self, pieces, staging, *, handle=None, direct=(), segments=None, stream=None, stop=None):
        """The bytes of the file into its temporary file, not yet published: pieces through staging (writer.write),
        direct: (offset, bytes) written from the tensors' own memory. stream: None, or stream(write) that produces
        the bytes of the placeholder tensors piece by piece from memory it reuses: write(offset, bytes) submits a
        positional write and returns its future, which stream waits before reusing that memory. It runs after the
        direct writes are submitted and before the staged pieces are assembled, so a staged source (the header)
        may depend on what it streamed (checksums). The staging is released once no request uses it. stop: None,
        or a callable checked at each staged window: True stops the write (writer.write's KeyboardInterrupt)."""
        try:
            with buffers.handle_for(handle) as h:
                self._write(h, pieces, staging, direct, segments, stream, stop)
        except WrittenInPlace:  # a source file's error, not the writing's: said as it is, naming that file
            staging.release()
            raise
        except OSError as exc:
            staging.release()  # every request was waited for: the buffers are free
            raise OSError(exc.errno, f"writing the checkpoint {self.pending.final} failed: "
                                     f"{exc.strerror or exc}", self.pending.final) from exc
        staging.release()  # (not after an interruption: a request may still be reading them)

    def _write(self, h, pieces, staging, direct, segments, stream, stop):
        """The direct requests are all submitted first (the handle copies misaligned memory through its own
        bounce buffers, pipelined with the device), then the stream's, then the staged pieces follow; every
        request is waited for before this returns or raises."""
        futures, error, pending, in_flight = [], None, self.pending, InFlight()

        def submit(offset, view):
            return in_flight.submit(lambda: h.pwrite(view, pending.path, offset, identity=pending.identity,
                                                     staged="auto"))

        try:
            for offset, view in direct:
                futures.append(submit(offset, view))
            if stream is not None:
                stream(submit)
            writer.write(h, pending.path, self.plan.total, pieces, staging, identity=pending.identity,
                         segments=segments, stop=stop)
        except OSError as exc:
            error = exc
        finally:
            error = writer.wait_all(futures, error)
        if error is not None:
            raise error

    def commit(self):
        """Publishes the file (commit.py); returns its size in bytes."""
        commit_pending(self.pending, self.plan.total)
        return self.plan.total

    def abort(self):
        """Removes the temporary file unless committed (a no-op after commit() or a previous abort())."""
        self.pending.abort()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.abort()
        return False


def split_pieces(plan, source=None):
    """(staged pieces at staging positions, segments, direct) of a plan (see the module and FileWriter.write)."""
    staged, direct = [(0, plan.header.numel(), lambda: plan.header)], []
    for offset, i in plan.pieces():
        e = plan.entries[i]
        t = e.tensor
        if source is not None:
            staged.append((offset, e.nbytes, source(i)))
        elif t.device.type == "meta":
            continue
        elif e.nbytes >= DIRECT_MIN and t.device.type == "cpu" and t.is_contiguous():
            direct.append((offset, flat_bytes(t)))
        else:
            staged.append((offset, e.nbytes, lambda t=t: flat_bytes(t)))
    segments, moved = writer.segments_of(staged)
    return moved, segments, direct
