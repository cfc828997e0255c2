"""Where each tensor goes in a checkpoint file: a safetensors header padded so the data begin 4 KiB-aligned.

A safetensors file is an 8-byte little-endian length N, N bytes of JSON, then the tensors' bytes packed back
to back (the format allows no gaps between them). JSON may end in spaces, so the header is padded with spaces
until 8 + N is a multiple of 4096: the data section then starts on a boundary O_DIRECT accepts, and the whole
file is written as aligned windows (the header riding in the first one). Tensors are ordered by element size,
largest first (as safetensors itself does), so every tensor starts at a multiple of its element size and can be
viewed in place as its dtype; within one element size, the tensors under 1 MiB come first (see plan()).
"""
import json
import struct

import torch

from .dtypes import stored_shape

ALIGN = 4096
SMALL = 1 << 20  # = load.DIRECT_MIN
FORMAT, VERSION = "swapio.checkpoint", "1"
META_FORMAT, META_VERSION, META_STRUCTURE = "format", "format_version", "structure"


def round_up(x, a=ALIGN):
    return (x + a - 1) // a * a


class Plan:
    """header: the padded header as a uint8 tensor (length prefix included); offsets[i]: the file offset of
    entries[i] (in the order given); total: the file size."""

    __slots__ = ("header", "entries", "offsets", "total")

    def __init__(self, header, entries, offsets, total):
        self.header, self.entries, self.offsets, self.total = header, entries, offsets, total

    def pieces(self):
        """(file offset, entry) in file order."""
        return sorted(zip(self.offsets, range(len(self.entries))), key=lambda p: p[0])


def plan(skeleton, entries, extra_metadata=None):
    # Largest element size first; within one size, tensors under 1 MiB first: load streams those through pinned
    # windows and reads the big ones straight into their memory, and a run of small ones is read in one go.
    order = sorted(range(len(entries)), key=lambda i: (-entries[i].tensor.element_size(),
                                                       entries[i].nbytes >= SMALL))  # stable
    relative, begin = [0] * len(entries), 0
    header = {}
    for i in order:
        e = entries[i]
        relative[i] = begin
        header[e.name] = {"dtype": e.dtype_name,
                          "shape": stored_shape(e.tensor.shape, e.tensor.dtype, e.raw),
                          "data_offsets": [begin, begin + e.nbytes]}
        begin += e.nbytes
    metadata = dict(extra_metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must be a dict of str to str (safetensors' __metadata__)")
    metadata.update({META_FORMAT: FORMAT, META_VERSION: VERSION,
                     META_STRUCTURE: json.dumps(skeleton, separators=(",", ":"))})
    text = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    data_start = round_up(8 + len(text))
    text += b" " * (data_start - 8 - len(text))
    raw = struct.pack("<Q", len(text)) + text
    head = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return Plan(head, entries, [data_start + r for r in relative], data_start + begin)
