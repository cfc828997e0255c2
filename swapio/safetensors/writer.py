"""The library's streaming writer: a file's bytes, gathered from many tensors, written as large aligned O_DIRECT
requests from a few pinned windows, several in flight. swapio.checkpoint's saves, swapio.offload's exports and
offload_dir's data files all go through it.

The file is cut into windows of W bytes (a whole number of MiB) at offsets j*W. Window j is assembled in
staging buffer j % n and handed to AioHandle.pwrite as one request (which the handle splits into block_size
pieces, queue_depth of them in flight); while the disk writes it, the next windows are filled. A buffer is
refilled only after its previous write completed, so at most n windows are in flight and host memory stays
n*W (the staging budget) whatever the file size. The last window is rounded up to 4 KiB so that every request
is aligned; the caller truncates the file to its true size before committing it. Bytes no piece covers (the
padding between tensors) are written as zeros, never as what an earlier file left in the reused buffers.

Sources: a piece is (file offset, byte count, source). A source is a callable returning the piece's bytes as a
1-D uint8 tensor on any device (called once, when its first byte is reached, and dropped after its last: a tensor
that must be made contiguous or brought from a GPU costs one such copy at a time), or None when the bytes are
already in the window's buffer (async_save captured them there: Staging.tail).
"""

import torch

from ..core.pinned import empty_pinned
from . import buffers
from .layout import ALIGN, round_up

MiB = 1 << 20


class Staging:
    """Pinned staging for a file of `total` bytes within `staging_bytes`: n windows of `window` bytes (at least
    one, at most as many as the file needs) in one pinned block, kept for the next save (buffers.py).
    `tail`: optional plain memory holding the file's bytes past the block (async_save's capture image): window
    j >= n is then tail's, written from there as it is. keep=False: the block is the writer's own, freed at
    release() (offload_dir writes once per model: nothing to keep it for), not the one kept for the next save."""

    def __init__(self, staging_bytes, total, window_bytes=64 * MiB, image=False, keep=True):
        w = max(MiB, min(window_bytes, staging_bytes // 2) // MiB * MiB)
        self.window = min(w, round_up(max(total, 1), MiB))
        # image (async_save's capture): the block holds whole windows of the file only, never more than the file
        # (the rest goes to the tail), so a capture costs about the file's size, not up to a window more
        needed = total // self.window if image else -(-total // self.window)
        self.n = max(1, min(staging_bytes // self.window, needed))
        self.room = self.n * self.window
        self._keep = keep
        self._whole = {"pinned": buffers.take("pinned", self.room) if keep else empty_pinned(self.room, torch.uint8)}
        self.block = self._whole["pinned"][:self.room]
        self.tail = None

    def add_tail(self, total):
        """Plain memory for the bytes [room, total) (rounded up to 4 KiB)."""
        if total > self.room:
            nbytes = round_up(total - self.room, ALIGN)
            self._whole["image"] = buffers.take("image", nbytes)
            self.tail = self._whole["image"][:nbytes]

    def buffer(self, j):
        if self.tail is not None and j >= self.n:
            start = j * self.window - self.room
            return self.tail[start:start + self.window]
        k = j % self.n
        return self.block[k * self.window:(k + 1) * self.window]

    def release(self):
        """Hands the memory back for the next save (call once no request uses it)."""
        whole, self._whole, self.block, self.tail = self._whole, {}, None, None
        if self._keep:
            for kind, t in whole.items():
                buffers.give_back(kind, t)


def segments_of(pieces):
    """The file ranges [start, end) that pieces cover, each laid out in staging at an address congruent to its
    file offset modulo 4 KiB: [(start, end, staging position)], and the pieces moved to staging positions."""
    segs, moved, v = [], [], 0
    for offset, nbytes, source in pieces:
        if not segs or offset != segs[-1][1]:
            if segs:
                v = segs[-1][2] + segs[-1][1] - segs[-1][0]
            v += (offset - v) % ALIGN
            segs.append([offset, offset, v])
        moved.append((segs[-1][2] + offset - segs[-1][0], nbytes, source))
        segs[-1][1] = offset + nbytes
    return [tuple(s) for s in segs], moved


def write(handle, path, total, pieces, staging, identity=None, segments=None, bar=None, stop=None):
    """Writes bytes [0, total) of the file at path from pieces (sorted by offset, together covering every byte
    that matters) through `staging` (a Staging). Returns once every request finished; raises the first error
    after waiting for all requests in flight (so no buffer is reused or freed under the kernel).
    segments: None (pieces cover the whole file, at their file offsets in staging) or [(start, end, position)]
    from segments_of: pieces are then at staging positions and only those file ranges are written, each by
    requests of exactly its bytes (the handle writes unaligned edges through a buffered descriptor).
    bar: a progress bar (or None), advanced by each window once its write finished. stop: None or a callable,
    asked before each window: True raises KeyboardInterrupt there (async_save abandoned at exit), once the requests
    in flight have finished."""
    w, n = staging.window, staging.n
    if segments is None:
        segments = [(0, total, 0)]
        span = total
    else:
        span = segments[-1][2] + segments[-1][1] - segments[-1][0] if segments else 0
    pending = [[] for _ in range(n)]
    i, data, error, si = 0, None, None, 0
    try:
        for j, start in enumerate(range(0, span, w)):
            if stop is not None and stop():
                raise KeyboardInterrupt("the write was abandoned (Ctrl-C as the interpreter exited)")
            buf = staging.buffer(j)
            waiting, pending[j % n] = pending[j % n], []
            for f, nbytes in waiting:
                f.wait()
                if bar is not None:
                    bar.update(nbytes)
            end = min(start + w, span)
            filled = start  # the window's bytes before this are set
            while i < len(pieces) and pieces[i][0] < end:
                offset, nbytes, source = pieces[i]
                a, b = max(offset, start), min(offset + nbytes, end)
                if a > filled:
                    buf[filled - start:a - start].zero_()
                filled = max(filled, b)
                if source is not None and nbytes:
                    if data is None:
                        data = source()
                    buf[a - start:b - start].copy_(data[a - offset:b - offset])
                if offset + nbytes > end:
                    break  # the piece goes on in the next window
                data = None
                i += 1
            if filled < end:
                buf[filled - start:end - start].zero_()
            while si < len(segments):
                s, e, v = segments[si]
                a, b = max(v, start), min(v + e - s, end)
                if a < b:
                    if e - s == total:  # the whole file (async_save's image): the last request rounded up
                        b = min(start + round_up(b - start, ALIGN), start + w)
                    pending[j % n].append((handle.pwrite(buf[a - start:b - start], path, s + a - v,
                                                         identity=identity, staged="auto"), b - a))
                if v + e - s > end:
                    break  # the segment goes on in the next window
                si += 1
    finally:
        left = [pair for fs in pending for pair in fs]
        error = wait_all([f for f, _ in left], error)
    if error is not None:
        raise error
    if bar is not None:
        bar.update(sum(nbytes for _, nbytes in left))


def wait_all(futures, error=None):
    """Waits for every future (none may still write into memory about to be reused or freed when an error
    propagates) and returns the first OSError: `error` if one was already caught, else the first a future
    raised, else None."""
    for f in futures:
        try:
            f.wait()
        except OSError as exc:
            error = error or exc
    return error
