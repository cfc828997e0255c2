"""The memory saves stage and capture through, kept for the next save.

Allocating it is not free: page-locking 256 MiB takes ~0.1 s, and faulting in a fresh multi-GiB snapshot costs
~1 s per GiB on a virtual machine (page population, not the copy, dominated async_save's stall before this).
So the last pinned block and the last unpinned capture image are kept after a save finishes and taken by the
next one that fits in them (a training loop saves the same state every time). release_buffers() frees them.
"""
import threading

import torch

from ..core.pinned import empty_pinned
from .layout import ALIGN

_lock = threading.Lock()
_spare: dict[str, torch.Tensor] = {}  # "pinned" / "image" -> a 1-D uint8 tensor


def take(kind, nbytes):
    """A 1-D uint8 tensor of at least nbytes, 4 KiB-aligned: the kept one of this kind if it is big enough,
    else a new one (pinned for kind "pinned", plain memory for "image"). Slice it; give the whole back."""
    with _lock:
        spare = _spare.pop(kind, None)
    if spare is not None and spare.numel() >= nbytes:
        return spare
    del spare  # too small: freed before the new one is allocated
    if kind == "pinned":
        return empty_pinned(max(nbytes, 1), torch.uint8)
    backing = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = -backing.data_ptr() % ALIGN
    return backing[shift:shift + nbytes]


def give_back(kind, whole):
    """Keeps `whole` (as take returned it) for the next save; the one kept before is let go."""
    if whole is not None and whole.numel():
        with _lock:
            _spare[kind] = whole


def release_buffers():
    """Frees the staging and capture memory kept from earlier saves."""
    with _lock:
        _spare.clear()
