"""Host memory that saved activations are read back into (to="nvme", CPU tensors): page-aligned blocks, 2 MiB
huge pages from 2 MiB on, handed out as the storages backward uses and taken back, for a later read, when the
last tensor using one dies.

Why: each read into fresh memory faulted its pages in (one fault and a page cleared per 4 KiB: about a third of
the offload's cost on a CPU model) and, the memory being neither aligned nor huge pages, went through the I/O
workers' bounce buffers (a copy). A recycled aligned block takes the direct read as it is, with no fault.
The blocks kept free are never more than the most a backward had in use at once.
"""
import bisect
import threading
import weakref

import torch

from .. import _C
from ..core._align import ALIGN, round_up
from ..core.pinned import size_class


class ReadBlocks:
    """Blocks for reads of saved activations. take(nbytes, shift) is a uint8 tensor of nbytes whose storage starts
    `shift` bytes into a block (the same address modulo ALIGN as the tensor that was written, so that the file
    offset and the memory are aligned alike); the block comes back here when that storage is gone."""

    def __init__(self):
        # Taken from storage finalizers too, which the garbage collector may run inside a section under it (any
        # allocation there can start it, and a tensor over a block caught in a reference cycle then dies): such a
        # block waits in _returned for the section to end. (With a plain Lock that finalizer waited for itself.)
        self._lock = threading.RLock()
        self._busy = False  # a section under the lock is running (in the thread holding the lock)
        self._returned = []  # (block, size) given back meanwhile
        self._free = []   # (size, id, PinnedBuffer) of the blocks kept free, smallest first
        self.in_use = 0   # bytes of blocks some storage uses
        self.cached = 0   # bytes of blocks kept free for the next reads
        self._peak = 0    # the most bytes in use at once: the bound on what is kept free
        self._closed = False

    def take(self, nbytes, shift):
        need = shift + nbytes
        with self._lock:
            self._busy = True
            try:
                # the smallest free block that holds it: a backward's reads vary in size from node to node, and
                # blocks of one size kept for each would hold more than the backward ever used at once
                i = bisect.bisect_left(self._free, (need,))
                if i < len(self._free):
                    size, _, block = self._free.pop(i)
                    self.cached -= size
                else:
                    size, block = round_up(size_class(need), ALIGN), None
                self.in_use += size
                self._peak = max(self._peak, self.in_use)
            finally:
                self._end_section()
        if block is None:
            try:
                block = _C.PinnedBuffer(size, False)  # mapped, not locked: only direct I/O touches it
            except BaseException:
                with self._lock:
                    self.in_use -= size
                raise
        view = memoryview(block)[shift:shift + nbytes]
        weakref.finalize(view, self._give_back, block, size).atexit = False
        return torch.frombuffer(view, dtype=torch.uint8)

    def _give_back(self, block, size):
        """The last storage using `block` is gone (runs in whichever thread dropped it)."""
        with self._lock:
            if self._busy:  # the collector ran this inside a section of this thread: it ends first
                self._returned.append((block, size))
                return
            self._busy = True
            try:
                self._keep(block, size)
            finally:
                self._end_section()

    def _keep(self, block, size):
        self.in_use -= size
        if self._closed:
            return
        self.cached += size
        bisect.insort(self._free, (size, id(block), block))
        while self.cached > self._peak:  # the smallest go first: a large block serves any read
            self.cached -= self._free.pop(0)[0]  # unmapped here (a mapping: no Python runs)

    def _end_section(self):
        """(Under the lock, at the end of a section:) takes the blocks given back meanwhile."""
        try:
            while self._returned:
                self._keep(*self._returned.pop())
        finally:
            self._busy = False

    def clear(self, closing=False):
        """Lets the free blocks go (the ones in use follow as their storages die, when closing)."""
        with self._lock:
            self._busy = True
            try:
                free, self._free = self._free, []
                self.cached = 0
                self._peak = self.in_use
                self._closed = self._closed or closing
            finally:
                self._end_section()
        free.clear()  # outside the lock: unmapping is the block's destructor
