"""The C heap's free pages given back to the system while gradients come and go (glibc's malloc_trim).

glibc raises its mmap threshold to the largest block freed (up to 32 MiB); from then on tensors of a few MiB,
such as autograd's gradients of a model's weights, come from the heap, and what they leave free between the
blocks still in use stays mapped: training offloaded weights frees one gradient after another in backward, and
without help the process kept hundreds of MiB of such free heap, more the more modules a step runs through.
HeapTrim gives the free pages back every `every` bytes freed (malloc_trim(0) releases the free pages inside the
heap, not only at its top), so host memory follows the tensors alive. Where the C library has no malloc_trim
(musl, macOS) it does nothing.
"""
import ctypes
import threading
from typing import Callable, Optional


def _resolve() -> Optional[Callable[[int], int]]:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _resolve()


def trim_heap() -> bool:
    """Gives the heap's free pages back now (the GIL released meanwhile); False where that is not available."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class HeapTrim:
    """Trims the heap once per `every` bytes reported freed (a trim costs a walk of the heap and page faults
    where the memory is used again: once per few dozen MiB, it is lost in the time those bytes took)."""

    def __init__(self, every: int = 64 << 20) -> None:
        self.every = every
        self.trims = 0
        self._freed = 0
        self._lock = threading.Lock()

    def freed(self, nbytes: int) -> None:
        with self._lock:
            self._freed += nbytes
            if self._freed < self.every:
                return
            self._freed = 0
        if trim_heap():
            with self._lock:
                self.trims += 1
