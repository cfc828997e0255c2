"""What async_save copies before it returns, so that training may change its tensors at once.

The first bytes of the file (header included), up to the staging budget, are copied straight into the pinned
staging block at their place in the file: those windows are written from there with no further copy, and the
block then serves as the staging for the rest. A tensor that does not fit whole in the block is copied to an
unpinned CPU snapshot (one allocation per tensor) and staged from there when its windows come. So during an
async save the process holds: the pinned block (staging_bytes) plus a CPU copy of the tensors beyond it.
"""
import torch

from . import writer
from .bytes_of import place


def capture(plan, staging_bytes):
    """(pieces, staging) with every byte of the file copied out of the live tensors."""
    staging = writer.Staging(staging_bytes, plan.total)
    block, room = staging.block, staging.block.numel()
    head = plan.header.numel()
    block[:head].copy_(plan.header)
    pieces = [(0, head, None)]
    for offset, i in plan.pieces():
        e = plan.entries[i]
        if offset + e.nbytes <= room:
            if e.nbytes:
                dst, src = place(block[offset:offset + e.nbytes], e.tensor)
                dst.copy_(src)
            pieces.append((offset, e.nbytes, None))
        else:
            snap = torch.empty(e.tensor.shape, dtype=e.tensor.dtype)
            dst, src = place(snap.reshape(-1).view(torch.uint8), e.tensor)
            dst.copy_(src)
            pieces.append((offset, e.nbytes, lambda s=snap: s.reshape(-1).view(torch.uint8)))
    return pieces, staging
