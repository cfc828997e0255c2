"""What async_save copies before it returns, so that training may change its tensors at once.

Every byte of the file is copied into an image of it: the first bytes (header included), up to the staging
budget, into the pinned staging block at their place in the file; the rest into plain (unpinned) page-aligned
memory, the tail. The background write then hands windows of the image to O_DIRECT as they are: no further
copy. A tensor that straddles the block's end is split between the two. Both buffers are kept for the next save
once the write has finished (buffers.py), so a training loop's later async_saves only pay for the copy.
While a save is in flight the process thus holds min(staging_bytes, file) pinned and the rest of the file in
plain memory, on top of the state itself.
"""
from . import writer
from .bytes_of import flat_bytes, place


def _put(staging, offset, t, nbytes):
    """Copies t's bytes (nbytes) to file offset `offset` of the image."""
    room = staging.room
    if offset + nbytes <= room:
        dst = staging.block[offset:offset + nbytes]
    elif offset >= room:
        dst = staging.tail[offset - room:offset - room + nbytes]
    else:  # across the end of the block: split its bytes (one contiguous copy if t is not contiguous)
        flat = flat_bytes(t)
        staging.block[offset:room].copy_(flat[:room - offset])
        staging.tail[:offset + nbytes - room].copy_(flat[room - offset:])
        return
    d, s = place(dst, t)  # typed: a non-contiguous tensor is copied in place without a temporary
    d.copy_(s)


def capture(plan, staging_bytes):
    """(pieces, staging) with every byte of the file copied out of the live tensors into staging."""
    staging = writer.Staging(staging_bytes, plan.total)
    try:
        staging.add_tail(plan.total)
        head = plan.header.numel()
        _put(staging, 0, plan.header, head)
        pieces = [(0, head, None)]
        for offset, i in plan.pieces():
            e = plan.entries[i]
            if e.nbytes:
                _put(staging, offset, e.tensor, e.nbytes)
            pieces.append((offset, e.nbytes, None))
    except BaseException:
        staging.release()  # nothing was submitted: the memory is free for the next save
        raise
    return pieces, staging
