"""The memory saves stage and capture through, and the handle saves and loads do their I/O with, kept for the
next save or load.

Allocating it is not free: page-locking 256 MiB takes ~0.1 s, and faulting in a fresh multi-GiB snapshot costs
~1 s per GiB on a virtual machine (page population, not the copy, dominated async_save's stall before this).
So the last pinned block and the last unpinned capture image are kept after a save finishes and taken by the
next one that fits in them (a training loop saves the same state every time). Likewise the last handle: its
workers' huge-page bounce buffers (64 MiB) are faulted in by its first staged request, which cost a 2 GiB load
into existing tensors 8 % of its time (0.91x of the raw read with a new handle, 0.99x with the kept one).
release_buffers() frees them all.
"""
import atexit
import contextlib
import numbers
import os
import threading
from typing import Optional

import torch

from ..core._align import ALIGN
from ..core.handle import AioHandle, check_moves_data
from ..core.pinned import empty_pinned

_lock = threading.Lock()
_spare: dict[str, torch.Tensor] = {}  # "pinned" / "image" -> a 1-D uint8 tensor
_spare_handle: list[AioHandle] = []   # at most one


def check_staging_bytes(staging_bytes):
    """staging_bytes as an int: a positive int, numpy's included (TypeError / ValueError otherwise)."""
    if not isinstance(staging_bytes, numbers.Integral) or isinstance(staging_bytes, bool):
        raise TypeError(f"staging_bytes must be a positive int (bytes), got {type(staging_bytes).__name__} "
                        f"{staging_bytes!r}")
    if staging_bytes <= 0:
        raise ValueError(f"staging_bytes must be a positive int (bytes), got {staging_bytes}")
    return int(staging_bytes)


def check_handle(handle):
    """TypeError unless handle is None or an AioHandle (an AttributeError on .pwrite came from deep inside)."""
    if handle is not None and not isinstance(handle, AioHandle):
        raise TypeError(f"handle must be a swapio.AioHandle, got {type(handle).__name__}")
    check_moves_data(handle, "a checkpoint")  # (None: the handle made for it, which SWAPIO_ENGINE may make null)


def new_handle():
    """The handle a checkpoint uses when the caller gives none: 1 MiB requests, 32 in flight per worker, two
    workers (each takes half of a window), O_DIRECT where the file system allows it."""
    return AioHandle(block_size=1 << 20, queue_depth=32, threads=2)


@contextlib.contextmanager
def handle_for(handle: Optional[AioHandle] = None):
    """`handle` if given (left open); else the kept handle, or a new one when none is kept (taken by another
    save or load in flight, closed, or inherited through fork()). After a clean exit that one is kept for the
    next call (one is kept; a second is closed); after an error or an interruption it is closed, since requests
    of the failed call may still be in flight."""
    if handle is not None:
        yield handle
        return
    with _lock:
        h = _spare_handle.pop() if _spare_handle else None
    if h is None or h.closed:
        h = new_handle()
    ok = False
    try:
        yield h
        ok = True
    finally:
        with _lock:
            keep = ok and not _spare_handle
            if keep:
                _spare_handle.append(h)
        if not keep:
            h.close()


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
    """Frees the staging and capture memory kept from earlier saves, and closes the kept handle."""
    with _lock:
        _spare.clear()
        handles = _spare_handle[:]
        _spare_handle.clear()
    for h in handles:
        h.close()


_inherited: list = []  # what a forked child got from its parent: never used (nor freed) there; see _fresh_after_fork


def _fresh_after_fork():
    """In a forked child: a free lock (another thread may have held it at the fork), and no kept buffers or
    handle. The handle's workers are not in the child, and the pinned memory may be registered with CUDA, which a
    forked child can neither use nor unregister: they are kept referenced, never touched."""
    global _lock, _spare, _spare_handle
    _inherited.append((_spare, _spare_handle))
    _lock, _spare, _spare_handle = threading.Lock(), {}, []


os.register_at_fork(after_in_child=_fresh_after_fork)

# The kept handle's workers stop before the interpreter goes (after async saves still writing: Python joins their
# threads before it runs atexit).
atexit.register(release_buffers)
