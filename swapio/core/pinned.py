"""Page-aligned, page-locked host tensors, a registry so views of them count as pinned, and the reuse of pinned
blocks (PinnedPool: blocks of recurring sizes; GrowingBlock: one buffer sized by its largest request)."""
import bisect
import math
import numbers
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from .. import _C
from ._align import round_up
from ._cudart import clear_last_error
from ._errors import check_int, warn_once

_lock = threading.Lock()
# The live blocks: start -> end, and their starts sorted for lookups. A Ctrl-C (KeyboardInterrupt, raised between
# bytecodes) can stop a change half done, so the changes keep in order that every start in _starts is in _ends:
# a block is added to _ends first, removed from _starts first. What an interrupted change can leave is an entry of
# _ends alone, which no lookup sees and the next change at that address replaces.
_starts: List[int] = []   # sorted start addresses of live pinned blocks
_ends: Dict[int, int] = {}     # start -> end
_cuda_registered: Set[int] = set()  # starts of blocks registered with CUDA
_live = [0, 0]  # bytes of live pinned blocks: now, and the most since the last reset (pinned_bytes)
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's
_registering = threading.Lock()  # one cudaHostRegister of a block at a time (a second would fail: "already")
_at_cuda_init = [False]  # whether _register_live_blocks is queued to run when this process initialises CUDA


def _register(start: int, end: int) -> None:
    with _lock:
        old = _ends.get(start)  # a block that died unregistered: its address is only reused once it is unmapped
        _ends[start] = end
        i = bisect.bisect_left(_starts, start)
        if i == len(_starts) or _starts[i] != start:
            _starts.insert(i, start)
        _live[0] += end - start - (old - start if old is not None else 0)
        _live[1] = max(_live[1], _live[0])


def _unregister(start: int) -> bool:
    with _lock:
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            del _starts[i]
        end = _ends.pop(start, None)
        if end is not None:
            _live[0] -= end - start
        registered = start in _cuda_registered
        _cuda_registered.discard(start)
    return registered


def pinned_bytes(reset_peak: bool = False) -> Tuple[int, int]:
    """(bytes of swapio's live pinned blocks, the most there were at once since the last reset): the process's
    own accounting, which also counts blocks the kernel refused to lock (RLIMIT_MEMLOCK). reset_peak=True
    starts the peak afresh at the current figure, after returning it."""
    with _lock:
        _live[0] = sum(end - start for start, end in _ends.items())  # exact again after an interrupted change
        out = (_live[0], max(_live[1], _live[0]))
        if reset_peak:
            _live[1] = _live[0]
    return out


def _cuda_in_use() -> bool:
    """True once this process has initialised CUDA. Checking never creates a context (is_available() would
    not either, but cudaHostRegister would, on the current device: GPU 0 for a rank that has not called
    set_device)."""
    return bool(torch.cuda.is_initialized())


def _block_of(ptr: int) -> Optional[Tuple[int, int]]:
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        end = _ends.get(_starts[i]) if i >= 0 else None
        if end is not None and ptr < end:
            return _starts[i], end
    return None


def _cuda_register_block(start: int, end: int, device: Optional[Union[int, torch.device]] = None) -> bool:
    """Registers a block with CUDA once; False (with a warning once) when CUDA refuses."""
    with _registering:
        with _lock:
            if start in _cuda_registered:
                return True
            if _ends.get(start) != end:  # freed meanwhile (the live-blocks pass races with frees)
                return False
        with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
            rc = int(torch.cuda.cudart().cudaHostRegister(start, end - start, _CUDA_HOST_REGISTER_PORTABLE))
        if rc != 0:
            clear_last_error()  # the failure is handled here; a later launch check must not report it
            warn_once("cudaHostRegister", f"cudaHostRegister failed ({rc}); host-to-device copies from "
                                          "swapio buffers will not be asynchronous")
            return False
        with _lock:
            _cuda_registered.add(start)
    return True


def _register_live_blocks() -> None:
    """Runs inside torch's CUDA initialisation (torch.cuda._lazy_call): every block allocated while CUDA was
    unused is registered now, so that torch sees it pinned (is_pinned(), asynchronous copies at full speed)
    from the first copy on, whoever makes it. Never raises: an exception here would fail CUDA's initialisation."""
    try:
        with _lock:
            blocks = [(start, _ends[start]) for start in _starts if start not in _cuda_registered]
        for start, end in blocks:
            _cuda_register_block(start, end)
    except Exception as exc:  # noqa: BLE001 - see above; the blocks are registered before their first copy
        warn_once("cudaHostRegister", f"registering swapio's pinned buffers with CUDA failed ({exc}); they "
                                      "are registered before their first copy by swapio instead")


def _register_when_cuda_starts() -> None:
    """Queues _register_live_blocks to run when this process initialises CUDA (once): creates no CUDA context."""
    if _at_cuda_init[0]:
        return
    _at_cuda_init[0] = True
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is not None:  # else (a torch without it) blocks are registered before their first copy only
        lazy_call(_register_live_blocks)


def _forget_registrations_in_child() -> None:
    """A forked child cannot use its parent's CUDA context: its copies of the blocks are not registered there,
    and unregistering them at free would touch CUDA in a child that may not use it."""
    _cuda_registered.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_registrations_in_child)


def cuda_register(tensor: torch.Tensor, device: Optional[Union[int, torch.device]] = None) -> bool:
    """Registers the swapio pinned block holding `tensor` with CUDA (no-op if it is not in one, or already is),
    so that non_blocking copies from it are asynchronous. Called right before the first copy to a GPU."""
    block = _block_of(tensor.data_ptr())
    if block is None:
        return False
    return _cuda_register_block(block[0], block[1], device)


def _release_hook(start: int) -> Callable[[int], None]:
    def release(ptr: int) -> None:
        if _unregister(start):
            torch.cuda.cudart().cudaHostUnregister(ptr)
    return release


def empty_pinned(shape: Union[int, Sequence[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor in page-aligned, page-locked memory, registered with CUDA if CUDA is in use.

    While this process has not initialised CUDA, nothing CUDA is done (no context is created); the block is then
    registered when this process initialises CUDA (a call queued with torch's lazy CUDA initialisation), so
    torch sees it pinned whoever copies from it, and at the latest by swapio right before its first GPU copy. The memory is returned to the OS when the last
    tensor or view using it dies. If the kernel refuses to lock it (RLIMIT_MEMLOCK), a warning is given once and
    the memory is used unlocked.
    """
    if isinstance(shape, (int, numbers.Integral)):  # (numpy's too, as torch.empty takes them)
        shape = (check_int("shape entry", shape, 0),)
    shape = tuple(check_int("shape entry", s, 0) for s in shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > sys.maxsize:
        raise ValueError(f"empty_pinned({shape}) with {dtype} would need {nbytes} bytes, more than this machine "
                         "can address")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = _C.PinnedBuffer(nbytes)
    if not buf.locked:
        warn_once("memlock", f"swapio could not lock pinned memory ({os.strerror(buf.lock_errno)}); raise "
                             "`ulimit -l` (RLIMIT_MEMLOCK) for page-locked buffers. Going on unlocked.")
    buf.on_free = _release_hook(buf.ptr)
    _register(buf.ptr, buf.ptr + nbytes)
    if _cuda_in_use():
        _cuda_register_block(buf.ptr, buf.ptr + nbytes)
    else:
        _register_when_cuda_starts()
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive as long as the storage lives
    return flat.view(dtype).view(shape)


def is_pinned(tensor: torch.Tensor) -> bool:
    """True if the tensor's memory lies in a swapio pinned block (views included) or torch says it is pinned."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"is_pinned needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        return False
    if tensor.layout != torch.strided:  # (a sparse tensor has no data_ptr: torch asks its parts)
        return _cuda_in_use() and tensor.is_pinned()
    if _block_of(tensor.data_ptr()) is not None:
        return True
    return _cuda_in_use() and tensor.is_pinned()  # memory torch pinned implies CUDA was initialised


# ---- reuse: pinning (mlock, cudaHostRegister) costs far more than a copy, so buffers that recur are kept ---------
def page_size(nbytes: int) -> int:
    """nbytes rounded up to whole pages (at least one): a block no larger than asked."""
    return round_up(max(int(nbytes), 1))


def size_class(nbytes: int) -> int:
    """nbytes rounded up to the next of 8 steps per power of two (64 KiB at least; at most 12.5 % more than
    asked), so that requests of nearby sizes share blocks."""
    n = max(int(nbytes), _MIN_CLASS)
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


_MIN_CLASS = 1 << 16


class PinnedPool:
    """Pinned uint8 blocks kept for reuse between uses of the same sizes (saved activations, step after step).

    alloc(nbytes) hands out a free block of size(nbytes) bytes whose last GPU copy has completed, else pins a new
    one; free(block, event) takes it back (`event`: a GPU copy that may still read or write it; the block is not
    handed out again before it completed); clear() gives the free blocks back to the OS, after their copies.
    `size`: page_size (blocks exactly as large as asked, in pages) or size_class (fewer distinct sizes). The
    blocks are ordinary swapio pinned blocks: a forked child inherits them like any memory, and their CUDA
    registration is forgotten there (see _forget_registrations_in_child)."""

    def __init__(self, size: Callable[[int], int] = page_size) -> None:
        self.size = size
        self._free: Dict[int, List[Tuple[torch.Tensor, Any]]] = {}  # block size -> [(block, event or None)]
        self.in_use = 0  # bytes of blocks handed out and not freed
        self.cached = 0  # bytes of blocks kept for reuse

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 block of size(nbytes) >= nbytes bytes (its first nbytes are the caller's)."""
        size = self.size(nbytes)
        block = None
        blocks = self._free.get(size, [])
        for i, (_, event) in enumerate(blocks):
            if event is None or event.query():
                block = blocks.pop(i)[0]
                self.cached -= size
                break
        if block is None:
            block = empty_pinned(size, torch.uint8)
        self.in_use += size
        return block

    def free(self, block: torch.Tensor, event: Any = None) -> None:
        """Takes a block of alloc() back; `event`: the last GPU copy using it, if one may still run."""
        size = block.numel()
        self.in_use -= size
        self.cached += size
        self._free.setdefault(size, []).append((block, event))

    def clear(self) -> None:
        """Gives the free blocks back to the OS (after the copies still using them finished)."""
        for blocks in self._free.values():
            for _, event in blocks:
                if event is not None:
                    event.synchronize()
        self._free.clear()
        self.cached = 0


class GrowingBlock:
    """One pinned uint8 block reused for every request, replaced by a larger one when asked for more than it
    holds: sized by the largest request so far (a staging buffer, a gradient buffer). The old block is let go
    before the new one is pinned, so the two never coexist. `size`: what a request of nbytes pins (page_size)."""

    def __init__(self, size: Callable[[int], int] = page_size) -> None:
        self.size = size
        self.block: Optional[torch.Tensor] = None

    def at_least(self, nbytes: int) -> torch.Tensor:
        """The block, holding at least nbytes bytes; nothing may read into or write from it while it grows."""
        if self.block is None or self.block.numel() < nbytes:
            self.block = None
            self.block = empty_pinned(self.size(nbytes), torch.uint8)
        return self.block

    @property
    def nbytes(self) -> int:
        return self.block.numel() if self.block is not None else 0

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of this block (so the next request may overwrite it)."""
        return self.block is not None and tensor.untyped_storage().data_ptr() == self.block.data_ptr()

    def release(self) -> None:
        """Lets the block go (freed once no view of it is left); the next at_least() pins a new one."""
        self.block = None
