"""The one streaming writer: a file's bytes, gathered from many tensors, written as large aligned O_DIRECT
requests from a few pinned windows, several in flight.

The file is cut into windows of W bytes (a whole number of MiB) at offsets j*W. Window j is assembled in
staging buffer j % n and handed to AioHandle.pwrite as one request (which the handle splits into block_size
pieces, queue_depth of them in flight); while the disk writes it, the next windows are filled. A buffer is
refilled only after its previous write completed, so at most n windows are in flight and host memory stays
n*W (the staging budget) whatever the file size. The last window is rounded up to 4 KiB so that every request
is aligned; the caller truncates the file to its true size before committing it.

Sources: a piece is (file offset, byte count, source). A source is a callable returning the piece's bytes as a
1-D uint8 tensor on any device (called once, when its first byte is reached, and dropped after its last: a tensor
that must be made contiguous or brought from a GPU costs one such copy at a time), or None when the bytes are
already in the window's buffer (async_save captured them there: Staging.tail).
"""

from . import buffers
from .layout import ALIGN, round_up

MiB = 1 << 20


class Staging:
    """Pinned staging for a file of `total` bytes within `staging_bytes`: n windows of `window` bytes (at least
    one, at most as many as the file needs) in one pinned block, kept for the next save (buffers.py).
    `tail`: optional plain memory holding the file's bytes past the block (async_save's capture image): window
    j >= n is then tail's, written from there as it is."""

    def __init__(self, staging_bytes, total, window_bytes=64 * MiB):
        w = max(MiB, min(window_bytes, staging_bytes // 2) // MiB * MiB)
        self.window = min(w, round_up(max(total, 1), MiB))
        self.n = max(1, min(staging_bytes // self.window, -(-total // self.window)))
        self.room = self.n * self.window
        self._whole = {"pinned": buffers.take("pinned", self.room)}
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
        for kind, t in whole.items():
            buffers.give_back(kind, t)


def write(handle, path, total, pieces, staging, identity=None):
    """Writes bytes [0, total) of the file at path from pieces (sorted by offset, together covering every byte
    that matters) through `staging` (a Staging). Returns once every request finished; raises the first error
    after waiting for all requests in flight (so no buffer is reused or freed under the kernel)."""
    w, n = staging.window, staging.n
    pending = [None] * n
    i, data, error = 0, None, None
    try:
        for j, start in enumerate(range(0, total, w)):
            buf = staging.buffer(j)
            if pending[j % n] is not None:
                f, pending[j % n] = pending[j % n], None
                f.wait()
            end = min(start + w, total)
            while i < len(pieces) and pieces[i][0] < end:
                offset, nbytes, source = pieces[i]
                if source is not None and nbytes:
                    if data is None:
                        data = source()
                    a, b = max(offset, start), min(offset + nbytes, end)
                    buf[a - start:b - start].copy_(data[a - offset:b - offset])
                if offset + nbytes > end:
                    break  # the piece goes on in the next window
                data = None
                i += 1
            pending[j % n] = handle.pwrite(buf[:round_up(end - start, ALIGN)], path, start, identity=identity)
    finally:
        for f in pending:
            if f is not None:
                try:
                    f.wait()
                except OSError as exc:
                    error = error or exc
    if error is not None:
        raise error
