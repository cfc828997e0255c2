"""What async_save copies before it returns, so that training may change its tensors at once.

Every byte of the file is copied into an image of it: the first bytes (header included), up to the staging
budget, into the pinned staging block at their place in the file; the rest into plain (unpinned) page-aligned
memory, the tail. The background write then hands windows of the image to O_DIRECT as they are: no further
copy. A tensor that straddles the block's end is split between the two. Both buffers are kept for the next save
once the write has finished (buffers.py), so a training loop's later async_saves only pay for the copy.
While a save is in flight the process thus holds min(staging_bytes, file) pinned and the rest of the file in
plain memory, on top of the state itself. The copies are split by bytes between the caller's thread and one
helper thread, with streaming stores between CPU tensors (2 GiB into kept buffers on the reference VM: 0.45 s on
one thread with torch's copy, 0.18-0.24 s on two, 0.13-0.14 s streaming).
"""
import threading

import torch

from .. import _C
from ..core._signals import start_shielded
from ..core.tensors import cpu_memory
from ..safetensors import writer
from ..safetensors.bytes_of import flat_bytes, place

CAPTURE_THREADS = 2  # the copy is memory-bound, but two threads take page faults and cache misses in parallel


def _jobs(staging, offset, t, nbytes):
    """The (destination, source) copies that put t's bytes (nbytes) at file offset `offset` of the image."""
    room = staging.room
    if offset + nbytes <= room:
        dst = staging.block[offset:offset + nbytes]
    elif offset >= room:
        dst = staging.tail[offset - room:offset - room + nbytes]
    else:  # across the end of the block: split its bytes (one contiguous copy if t is not contiguous)
        flat = flat_bytes(t)
        return [(staging.block[offset:room], flat[:room - offset]),
                (staging.tail[:offset + nbytes - room], flat[room - offset:])]
    return [place(dst, t)]  # typed: a non-contiguous tensor is copied in place without a temporary


def _copy(d, s):
    """d.copy_(s); between contiguous CPU tensors with streaming stores (the image is not read again before the
    device reads it: that spares the reads of its lines a plain copy makes, a third of the memory traffic)."""
    if (d.device.type == "cpu" and s.device.type == "cpu" and d.is_contiguous() and s.is_contiguous()
            and not (s.is_conj() or s.is_neg())):
        dst, nbytes = cpu_memory(d, "the capture image")
        src, size = cpu_memory(s, "a tensor of the state")  # ValueError if its storage was shrunk under it
        if size != nbytes:
            raise ValueError(f"capture: {size} bytes into {nbytes}")  # (not reached: the plan sized d from s)
        if nbytes:
            _C.copy_bytes(dst, src, nbytes)
    else:
        d.copy_(s)


def _copy_all(jobs, threads):
    """Runs the copies, split by bytes between `threads` threads (neither copy holds the GIL)."""
    if threads < 2 or len(jobs) < 2:
        for d, s in jobs:
            _copy(d, s)
        return
    total = sum(d.numel() * d.element_size() for d, _ in jobs)
    half, acc, cut = total / 2, 0, len(jobs)
    for k, (d, _) in enumerate(jobs):
        acc += d.numel() * d.element_size()
        if acc >= half:
            cut = k + 1
            break
    error = []

    def run(part):
        try:
            for d, s in part:
                _copy(d, s)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    helper = threading.Thread(target=run, args=(jobs[cut:],), name="swapio-capture")
    try:  # an interrupt anywhere here must not leave the helper copying into staging the caller then frees
        start_shielded(helper)
        for d, s in jobs[:cut]:  # (on this thread: its error or Ctrl-C propagates as it is, after the join)
            _copy(d, s)
    finally:  # (the loop is inline: an interrupt can land at any call, one into a helper function included)
        interrupted = None
        while True:
            try:
                if helper.ident is not None:  # started
                    helper.join()
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted
    if error:
        raise error[0]


def capture(plan, staging_bytes):
    """(pieces, staging) with every byte of the file copied out of the live tensors into staging."""
    staging = writer.Staging(staging_bytes, plan.total, image=True)
    try:
        staging.add_tail(plan.total)
        head = plan.header.numel()
        jobs = _jobs(staging, 0, plan.header, head)
        pieces = [(0, head, None)]
        for offset, i in plan.pieces():
            e = plan.entries[i]
            if e.nbytes:
                jobs += _jobs(staging, offset, e.tensor, e.nbytes)
            pieces.append((offset, e.nbytes, None))
        with torch.no_grad():
            _copy_all(jobs, CAPTURE_THREADS)
    except BaseException:
        staging.release()  # nothing was submitted: the memory is free for the next save
        raise
    return pieces, staging
