"""Pinned staging for parameters on a GPU in cpu mode: gradients come in and updated parameters go out through
a few page-locked buffers, so that the copies are asynchronous."""
import torch

from ..core.pinned import empty_pinned


class CudaStaging:
    """A few pinned buffers in rotation for gradients coming from and parameters going to a GPU. A buffer is
    reused only after the copies queued from it have finished (a CUDA event per buffer)."""

    def __init__(self, slot_bytes, count=2):
        self.slot_bytes, self.count = slot_bytes, count
        self._buffers = None
        self._events = [[] for _ in range(count)]
        self._next = 0

    @property
    def capacity(self):
        """Elements per buffer pair (gradient in, parameter out, each up to 4 bytes an element): a multiple of
        1024, so of the int8 block."""
        return max(1024, self.slot_bytes // 8 // 1024 * 1024)

    @property
    def pinned_bytes(self):
        return self.capacity * 8 * self.count if self._buffers is not None else 0

    def acquire(self):
        if self._buffers is None:
            self._buffers = [empty_pinned(self.capacity * 8, torch.uint8) for _ in range(self.count)]
        i = self._next
        self._next = (i + 1) % self.count
        self.sync(i)
        buf = self._buffers[i]
        half = self.capacity * 4
        return i, buf[:half], buf[half:]

    def record(self, i, device):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._events[i].append(ev)

    def sync(self, i=None):
        for j in range(self.count) if i is None else (i,):
            for ev in self._events[j]:
                ev.synchronize()
            self._events[j] = []
