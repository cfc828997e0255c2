"""Where each tensor goes in a safetensors file swapio writes: a header padded so the data begin 4 KiB-aligned.

A safetensors file is an 8-byte little-endian length N, N bytes of JSON, then the tensors' bytes packed back
to back (the format allows no gaps between them). JSON may end in spaces, so the header is padded with spaces
until 8 + N is congruent modulo 4096 to the address of the first big tensor: the big CPU tensors whose addresses
allow it come first, back to back, each at a file offset congruent to its address (_congruent_chain), so that
O_DIRECT writes them from their own memory with no copy. (Without such tensors the data start 4 KiB-aligned.)
The rest are ordered by element size, largest first (as safetensors itself does), so every tensor starts at a
multiple of its element size and can be viewed in place as its dtype; within one element size, the tensors under
1 MiB come first (see plan()).
"""
import json
import struct

import torch

from ..core._align import ALIGN, round_up
from ..core.tensors import storage_bytes_needed
from .dtypes import stored_as, stored_shape
from .header import MAX_HEADER

SMALL = 1 << 20  # = swapio.checkpoint.load.DIRECT_MIN


class Entry:
    """One tensor to store: its name, the tensor (`original` as given, `tensor` detached), and how it is stored
    (dtypes.stored_as; `key` names it in a TypeError)."""

    __slots__ = ("name", "tensor", "original", "dtype_name", "raw", "nbytes")

    def __init__(self, name, original, key):
        if original.numel() and original.device.type != "meta":  # (torch's "setStorage: ... out of bounds" as
            # the file was being written; async_save's capture said so)
            needed, held = storage_bytes_needed(original), original.untyped_storage().nbytes()
            if needed > held:
                raise ValueError(f"{key}: the tensor spans {needed} bytes of its storage, which holds only {held} "
                                 "(released by SwapStore.swap_out(release=True), or resized): swap it in first")
        self.name, self.original, self.tensor = name, original, original.detach()
        self.dtype_name, self.raw = stored_as(original.dtype, key)
        self.nbytes = original.numel() * original.element_size()


class Plan:
    """header: the padded header as a uint8 tensor (length prefix included); offsets[i]: the file offset of
    entries[i] (in the order given); total: the file size."""

    __slots__ = ("header", "entries", "offsets", "total")

    def __init__(self, header, entries, offsets, total):
        self.header, self.entries, self.offsets, self.total = header, entries, offsets, total

    def pieces(self):
        """(file offset, entry) in file order."""
        return sorted(zip(self.offsets, range(len(self.entries))), key=lambda p: p[0])


def _congruent_chain(entries):
    """(residue r, [entry index]): big contiguous CPU tensors that, written back to back from a file offset
    congruent to r modulo 4 KiB, each lie at a file offset congruent to their address, so that O_DIRECT writes
    them from their own memory with no copy (file_writer.py). r is the address residue holding the most bytes; a tensor
    whose size is a multiple of 4 KiB keeps the chain going, one of another size (a multiple of 16) may end it
    (or go on with tensors at its end's residue). Sizes stay multiples of 16, so every tensor after the chain
    still starts at a multiple of its element size. (0, []) when there is none."""
    cand = {}
    for i, e in enumerate(entries):
        t = e.tensor
        if e.nbytes >= SMALL and e.nbytes % 16 == 0 and t.device.type == "cpu" and t.is_contiguous() \
                and t.data_ptr() % 16 == 0:
            cand.setdefault(t.data_ptr() % ALIGN, []).append(i)
    if not cand:
        return 0, []
    r = max(cand, key=lambda k: (sum(entries[i].nbytes for i in cand[k]), -k))
    for k in cand:  # those keeping the residue first, then the largest
        cand[k].sort(key=lambda i: (entries[i].nbytes % ALIGN != 0, -entries[i].nbytes, i))
    chain, p = [], r
    while cand.get(p % ALIGN):
        i = cand[p % ALIGN].pop(0)
        chain.append(i)
        p += entries[i].nbytes
    return r, chain


def plan(entries, metadata):
    """The Plan of a file of `entries` with the __metadata__ `metadata` ({str: str}) laid out for zero-copy
    writes and reads: first the chain of big tensors congruent to their place in the file (_congruent_chain), then
    by element size, largest first; within one size, tensors under 1 MiB first (a loader streams those through
    pinned windows and reads the big ones straight into their memory, and a run of small ones is read in one go)."""
    residue, chain = _congruent_chain(entries)
    chained = set(chain)
    order = chain + sorted((i for i in range(len(entries)) if i not in chained),
                           key=lambda i: (-entries[i].tensor.element_size(), entries[i].nbytes >= SMALL))  # stable
    return _pack(entries, order, metadata, residue)


def plain(entries, metadata):
    """The plan of a plain safetensors file, what save_pretrained writes (no swapio structure: `metadata` is the
    whole __metadata__), data 4 KiB-aligned. Tensors by element size, largest first, else in the order given
    (swapio.offload.export orders them so that each offloaded record is fetched once)."""
    order = sorted(range(len(entries)), key=lambda i: -entries[i].tensor.element_size())  # stable
    return _pack(entries, order, metadata, 0)


def _check_unicode(what, text):
    """ValueError for a str UTF-8 cannot encode (a lone surrogate, as os.listdir makes of a file name that is not
    UTF-8): json.dumps writes it as an escape that the safetensors library refuses to read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {text!r} is not valid Unicode (it holds a lone surrogate): safetensors readers "
                         "refuse it; rename it") from None


def _pack(entries, order, metadata, residue):
    """The Plan of entries laid out back to back in `order`, the data starting at an offset congruent to
    `residue` modulo 4 KiB."""
    for what, text in [("metadata key", k) for k in metadata] + [("metadata value", v) for v in metadata.values()]:
        _check_unicode(what, text)
    relative, begin = [0] * len(entries), 0
    header = {}
    for i in order:
        e = entries[i]
        _check_unicode("tensor name", e.name)
        relative[i] = begin
        header[e.name] = {"dtype": e.dtype_name,
                          "shape": stored_shape(e.tensor.shape, e.tensor.dtype, e.raw),
                          "data_offsets": [begin, begin + e.nbytes]}
        begin += e.nbytes
    text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    data_start = round_up(8 + len(text) - residue) + residue  # congruent to the chain's residue (0: aligned)
    text += b" " * (data_start - 8 - len(text))
    if len(text) > MAX_HEADER:
        raise ValueError(f"the checkpoint's header (tensor names, shapes and the JSON of the non-tensor values) "
                         f"would be {len(text)} bytes, over the {MAX_HEADER} bytes (100 MiB) limit that "
                         "safetensors readers accept: store big non-tensor values as tensors, or in fewer tensors")
    raw = struct.pack("<Q", len(text)) + text
    head = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return Plan(head, entries, [data_start + r for r in relative], data_start + begin)
