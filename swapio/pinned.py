"""Page-aligned, page-locked host tensors, and a registry so views of them count as pinned."""
import bisect
import math
import os
import threading

import torch

from . import _C
from ._errors import check_int, warn_once

_lock = threading.Lock()
_starts = []   # sorted start addresses of live pinned blocks
_ends = {}     # start -> end


def _register(start, end):
    with _lock:
        bisect.insort(_starts, start)
        _ends[start] = end


def _unregister(start):
    with _lock:
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            del _starts[i]
            del _ends[start]


def _cuda_pinning_available():
    return torch.cuda.is_available()


def _release_hook(start, cuda_registered):
    def release(ptr):
        _unregister(start)
        if cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    return release


def empty_pinned(shape, dtype=torch.float32):
    """An uninitialised tensor in page-aligned, page-locked memory, registered with CUDA when present.

    The memory is returned to the OS when the last tensor or view using it dies. If the kernel refuses to
    lock it (RLIMIT_MEMLOCK), a warning is given once and the memory is used unlocked.
    """
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(check_int("shape entry", s, 0) for s in shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = _C.PinnedBuffer(nbytes)
    if not buf.locked:
        warn_once("memlock", f"swapio could not lock pinned memory ({os.strerror(buf.lock_errno)}); raise "
                             "`ulimit -l` (RLIMIT_MEMLOCK) for page-locked buffers. Going on unlocked.")
    cuda_registered = False
    if _cuda_pinning_available():
        rc = torch.cuda.cudart().cudaHostRegister(buf.ptr, nbytes, 0)
        cuda_registered = int(rc) == 0
        if not cuda_registered:
            warn_once("cudaHostRegister", f"cudaHostRegister failed ({rc}); host-to-device copies from "
                                          "swapio buffers will not be asynchronous")
    buf.on_free = _release_hook(buf.ptr, cuda_registered)
    _register(buf.ptr, buf.ptr + nbytes)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive as long as the storage lives
    return flat.view(dtype).view(shape)


def is_pinned(tensor):
    """True if the tensor's memory lies in a swapio pinned block (views included) or torch says it is pinned."""
    if tensor.device.type != "cpu":
        return False
    ptr = tensor.data_ptr()
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        if i >= 0 and ptr < _ends[_starts[i]]:
            return True
    return torch.cuda.is_available() and tensor.is_pinned()
