"""The library's one reader of tensor bytes: read_into fills tensors from their Locations; load_file is a
safetensors checkpoint into memory, like safetensors.torch.load_file, without mmap (swapio.offload.load_file).

Each file is streamed in windows of `staging_bytes` / 2: a window is one aligned O_DIRECT request into one of two
pinned buffers (zero copy), and while the next window is read, the tensors' bytes in this one are copied to
their destinations: each tensor its own allocation on `device` (copied on the side stream for a GPU, a buffer
being refilled only after the copies out of it completed). Host memory beyond the result stays within
staging_bytes whatever the checkpoint size.
"""
import os

import torch

from ..core import cuda_copy
from ..core._align import ALIGN, round_up
from ..core.handle import AioHandle
from ..core.pinned import empty_pinned
from .buffers import check_handle, check_staging_bytes
from .files import check_unchanged
from .opened import open_checkpoint


def read_end(data_end, file_size):
    """Where an aligned read of bytes up to data_end stops: data_end rounded up to 4 KiB, but not past the end of
    the file; never before data_end, so a file that shrank since its header was read makes the read fail
    (ENODATA) instead of leaving bytes unread."""
    return max(data_end, min(round_up(data_end), file_size))


def _pieces(items, start, end):
    """(tensor index, offset in tensor, offset in window, length) of the tensors' bytes in [start, end)."""
    for i, loc in items:
        a, b = max(loc.offset, start), min(loc.offset + loc.nbytes, end)
        if a < b:
            yield i, a - loc.offset, a - start, b - a


def load_file(checkpoint, device="cpu", *, handle=None, staging_bytes=128 << 20):
    """{name: tensor} of a safetensors file, a save_pretrained directory or a sharded index."""
    staging_bytes = check_staging_bytes(staging_bytes)
    check_handle(handle)
    device = cuda_copy.usable_device(device, "load_file")
    locations = open_checkpoint(checkpoint)
    names = list(locations)
    out = []
    for name in names:
        with cuda_copy.allocating_on_side_stream(device):
            out.append(torch.empty(locations[name].shape, dtype=locations[name].dtype, device=device))
    # two windows that hold the largest file's tensors at most: a generous staging_bytes allocates no more
    span = max((loc.offset + loc.nbytes for loc in locations.values()), default=0)
    read_into([(locations[name], t) for name, t in zip(names, out)], device, handle=handle,
              staging_bytes=min(staging_bytes, 2 * round_up(span + ALIGN)))
    check_unchanged(locations.values())
    return dict(zip(names, out))


def read_into(pairs, device="cpu", *, handle=None, staging_bytes=128 << 20):
    """Fills each contiguous tensor of [(Location, tensor)] (all on `device`) with the bytes at its Location,
    streamed as load_file does (the module's docstring)."""
    device = cuda_copy.normalize_device(device)
    locations = [loc for loc, _ in pairs]
    flat = [t.reshape(-1).view(torch.uint8) if t.numel() else None for _, t in pairs]
    out = [t for _, t in pairs]
    window = max(ALIGN, staging_bytes // 2 // ALIGN * ALIGN)
    cuda = device.type == "cuda"
    stream = cuda_copy.copy_stream(device) if cuda else None
    if cuda:  # the tensors may be the caller's (load's out=, a model's parameters), read or written by work its
        # stream still has queued: the side stream's copies into them come after that work (a wait on the GPU)
        stream.wait_stream(torch.cuda.current_stream(device))
    buffers, events = [empty_pinned(window, torch.uint8) for _ in range(2)], [None, None]
    own = handle is None  # opened last, right before the try that closes it (a failed allocation left it open)
    handle = AioHandle() if own else handle
    try:
        by_file = {}
        for i, loc in enumerate(locations):
            if loc.nbytes:
                by_file.setdefault(loc.path, []).append((i, loc))
        for path, items in by_file.items():
            items.sort(key=lambda x: x[1].offset)
            first = items[0][1].offset // ALIGN * ALIGN
            io_path, identity = items[0][1].io_path, items[0][1].identity
            last = read_end(max(loc.offset + loc.nbytes for _, loc in items), os.path.getsize(io_path))
            starts = list(range(first, last, window))

            def submit(k):
                if events[k % 2] is not None:
                    events[k % 2].synchronize()  # the copies out of this buffer have finished
                    events[k % 2] = None
                n = min(window, last - starts[k])
                return handle.pread(buffers[k % 2][:n], io_path, starts[k], identity=identity)

            pending = submit(0)
            for k, start in enumerate(starts):
                pending.wait()
                if k + 1 < len(starts):
                    pending = submit(k + 1)
                buf, end = buffers[k % 2], min(start + window, last)
                for i, at, off, n in _pieces(items, start, end):
                    if cuda:
                        events[k % 2] = cuda_copy.copy_async(flat[i][at:at + n], buf[off:off + n], stream)
                    else:
                        flat[i][at:at + n].copy_(buf[off:off + n])
    finally:
        try:
            if own:
                handle.close()
        finally:
            if cuda:  # after an error too: copies queued before it may still write the tensors, and what the caller
                # queues next (writing them again after a failed load) must not be overtaken by them
                current = torch.cuda.current_stream(device)
                for ev in events:
                    if ev is not None:
                        current.wait_event(ev)
                for t in out:
                    t.record_stream(current)
