"""PinnedRing: buffer_bytes of pinned memory handed out as 4 KiB-aligned regions.

Regions are taken next-fit from a cursor that walks around the arena, so a stream of fetches released in the
order they were taken uses it as a ring; regions released out of order (a mispredicted prefetch, nested
modules) are coalesced with their free neighbours. The arena is allocated on first use.
"""
import bisect

import torch

from ..core.pinned import empty_pinned
from .layout import ALIGN, round_up


class PinnedRing:
    def __init__(self, capacity):
        self.capacity = capacity // ALIGN * ALIGN
        self._arena = None
        self._free = [(0, self.capacity)] if self.capacity else []  # sorted, coalesced (start, size)
        self._cursor = 0
        self.in_use = 0

    @property
    def arena(self):
        if self._arena is None:
            self._arena = empty_pinned(self.capacity, torch.uint8)
        return self._arena

    def owns(self, tensor):
        return self._arena is not None and tensor.untyped_storage().data_ptr() == self._arena.data_ptr()

    def alloc(self, nbytes):
        """(start, region tensor) of round_up(nbytes) bytes, or None if no free extent is large enough now."""
        n = round_up(max(nbytes, 1))
        order = sorted(range(len(self._free)), key=lambda i: (self._free[i][0] < self._cursor, self._free[i][0]))
        for i in order:
            start, size = self._free[i]
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, size - n)
                self._cursor = start + n
                self.in_use += n
                return start, self.arena[start:start + n]
        return None

    def free(self, start, nbytes):
        n = round_up(max(nbytes, 1))
        self.in_use -= n
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, n))
        if i + 1 < len(self._free) and start + n == self._free[i + 1][0]:  # merge with the next extent
            self._free[i] = (start, n + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and with the previous one
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def release_arena(self):
        """Returns the arena's memory (only when no region is in use)."""
        if self.in_use == 0:
            self._arena = None
