"""The alignment swapio lays out its files and pinned buffers by: one owner, so the optimizer's swap file and
checkpoints (and parameter offload's records) agree.

Direct I/O needs buffer addresses, file offsets and lengths aligned to what the file system asks (statx
STATX_DIOALIGN; the core probes it per file and falls back to 4096, see swapio.info(path)). swapio's pinned
buffers are page-aligned (csrc/mem/pinned.cpp), so the page size bounds what a zero-copy transfer can honour;
4096 is the floor because every Linux file system that takes O_DIRECT accepts it.
"""
import mmap

ALIGN = max(4096, mmap.PAGESIZE)


def round_up(x: int, a: int = ALIGN) -> int:
    """x rounded up to a multiple of a."""
    return (x + a - 1) // a * a


def round_down(x: int, a: int = ALIGN) -> int:
    """x rounded down to a multiple of a."""
    return x // a * a
