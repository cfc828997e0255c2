"""PinnedPool: swapio pinned blocks for saved activations, cached by size class between steps.

Pinning (mlock, cudaHostRegister) costs far more than a copy, and every training step saves tensors of the same
sizes again, so freed blocks are kept and handed out again. Sizes are rounded up to one of eight classes per
power of two (at most 12.5 % more than asked). A block freed while a GPU copy may still read or write it carries
that copy's event and is not handed out before the event completed. clear() gives all cached memory back.
"""
import torch

from ..core.pinned import empty_pinned

_MIN_CLASS = 1 << 16


def size_class(nbytes):
    """nbytes rounded up to the next of 8 steps per power of two (64 KiB at least)."""
    n = max(int(nbytes), _MIN_CLASS)
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


class PinnedPool:
    def __init__(self):
        self._free = {}    # size class -> [(block, event or None)]
        self.in_use = 0    # bytes of blocks handed out and not freed
        self.cached = 0    # bytes of blocks kept for reuse

    def alloc(self, nbytes):
        """A pinned uint8 block of at least nbytes bytes (its first nbytes are the caller's)."""
        cls = size_class(nbytes)
        blocks = self._free.get(cls)
        block = None
        if blocks:
            for i, (b, event) in enumerate(blocks):
                if event is None or event.query():
                    block = blocks.pop(i)[0]
                    self.cached -= cls
                    break
        if block is None:
            block = empty_pinned(cls, torch.uint8)
        self.in_use += cls
        return block

    def free(self, block, event=None):
        """Takes a block back; `event`: the last GPU copy using it, if one may still run."""
        cls = block.numel()
        self.in_use -= cls
        self.cached += cls
        self._free.setdefault(cls, []).append((block, event))

    def clear(self):
        """Gives the cached blocks back to the OS (after the copies still using them finished)."""
        for blocks in self._free.values():
            for _, event in blocks:
                if event is not None:
                    event.synchronize()
        self._free.clear()
        self.cached = 0
