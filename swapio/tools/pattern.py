"""The --verify data pattern, and the offsets of the native random requests it is checked at.

The 8-byte word at file offset 8*w holds w*K + C (mod 2^64), so a block read from the wrong offset, a torn
write or a flipped bit all show.
"""
import numpy as np

from .. import _C

_K = np.uint64(0x9E3779B97F4A7C15)
_C0 = np.uint64(0x5A17B0C55A17B0C5)


class Pattern:
    """Bytes that say where they belong, filled into and checked in uint64 word arrays."""

    def __init__(self, nbytes):
        with np.errstate(over="ignore"):
            self.base = np.arange(nbytes // 8, dtype=np.uint64) * _K + _C0
        self.scratch = np.empty(min(self.base.size, 1 << 17), dtype=np.uint64)

    @staticmethod
    def _shift(offset):
        return np.uint64(((offset // 8) * int(_K)) % (1 << 64))

    def fill(self, words, offset):
        n = words.size
        with np.errstate(over="ignore"):
            np.add(self.base[:n], self._shift(offset), out=words)

    def first_mismatch(self, words, offset):
        """Offset of the first wrong byte in `words` (read from file offset `offset`), or None."""
        step = 1 << 17  # compare 1 MiB at a time: small temporaries, no page faults
        for a in range(0, words.size, step):
            got = words[a:a + step]
            want = self.scratch[:got.size]
            with np.errstate(over="ignore"):
                np.add(self.base[a:a + got.size], self._shift(offset), out=want)
            if not np.array_equal(got, want):
                w = int(np.flatnonzero(got != want)[0])
                diff = (int(got[w]) ^ int(want[w])).to_bytes(8, "little")
                return offset + 8 * (a + w) + next(i for i, b in enumerate(diff) if b)
        return None

    def fill_pieces(self, words, offsets, bs):
        wpp = bs // 8
        with np.errstate(over="ignore"):
            shift = (offsets // np.uint64(8)) * _K
            np.add(self.base[None, :wpp], shift[:, None], out=words.reshape(-1, wpp)[:offsets.size])

    def first_mismatch_pieces(self, words, offsets, bs):
        wpp = bs // 8
        got = words.reshape(-1, wpp)[:offsets.size]
        with np.errstate(over="ignore"):
            want = self.base[None, :wpp] + ((offsets // np.uint64(8)) * _K)[:, None]
        bad = np.flatnonzero((got != want).any(axis=1))
        if bad.size == 0:
            return None
        j = int(bad[0])
        return int(offsets[j]) + 8 * int(np.flatnonzero(got[j] != want[j])[0])


def random_offsets(seed, count, span, bs):
    """The file offsets (uint64) the native submit_random(seed, count) visits, piece i going to slot
    i % slots: computed by the native core itself, so the two cannot drift."""
    return np.frombuffer(_C.random_offsets(seed, count, span, bs), dtype=np.uint64)
