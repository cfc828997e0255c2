"""Fast checksums of tensor bytes (xxh3, 64 bits) for SwapStore(verify=True) and optimizer checkpoints."""
import ctypes

import xxhash

ALGORITHM = "xxh3_64"


def _bytes(tensor):
    """The bytes of a contiguous CPU tensor, without a copy. Not through .numpy(): that would mark the storage
    as borrowed, and torch would then refuse to free it (release=True)."""
    nbytes = tensor.numel() * tensor.element_size()
    return (ctypes.c_char * nbytes).from_address(tensor.data_ptr()) if nbytes else b""


def digest(tensor):
    """The checksum of a contiguous CPU tensor's bytes."""
    return xxhash.xxh3_64_intdigest(_bytes(tensor))


class Stream:
    """The checksum of a sequence of fp32 pieces fed in order; update(first, view) checks the order."""

    __slots__ = ("_hash", "_next")

    def __init__(self):
        self._hash, self._next = xxhash.xxh3_64(), 0

    def update(self, first, view):
        if first != self._next:
            raise RuntimeError(f"checksum fed out of order: element {first}, expected {self._next}")
        self._hash.update(_bytes(view))
        self._next = first + view.numel()

    def intdigest(self):
        return self._hash.intdigest()
