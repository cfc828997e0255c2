"""load_file: a safetensors checkpoint into memory, like safetensors.torch.load_file, without mmap.

To the CPU, every tensor gets its own allocation and one read request, all in flight at once (the I/O core
reads the aligned middle of each with O_DIRECT, through bounce buffers when the allocation is not 4 KiB
aligned). To a GPU, tensors are read in batches into two pinned staging buffers of `staging_bytes` / 2 and
copied on the side stream, a buffer being refilled only after the copy out of it completed, so host memory
stays within staging_bytes whatever the checkpoint size.
"""
import torch

from .. import cuda_copy
from ..handle import AioHandle
from ..pinned import empty_pinned
from .layout import TENSOR_ALIGN, round_up
from .safetensors_format import open_checkpoint


def _batches(items, limit):
    batch, size = [], 0
    for name, loc in items:
        need = round_up(loc.nbytes, TENSOR_ALIGN)
        if batch and size + need > limit:
            yield batch
            batch, size = [], 0
        batch.append((name, loc, size))
        size += need
    if batch:
        yield batch


def load_file(checkpoint, device="cpu", *, handle=None, staging_bytes=256 << 20):
    """{name: tensor} of a safetensors file, a save_pretrained directory or a sharded index."""
    device = cuda_copy.normalize_device(device)
    locations = open_checkpoint(checkpoint)
    own = handle is None
    handle = AioHandle() if own else handle
    try:
        items = sorted(locations.items(), key=lambda kv: (kv[1].path, kv[1].offset))
        out = {}
        if device.type == "cpu":
            reads = []
            for name, loc in items:
                t = out[name] = torch.empty(loc.shape, dtype=loc.dtype)
                if loc.nbytes:
                    reads.append(handle.pread(t.view(-1).view(torch.uint8), loc.path, loc.offset))
            for f in reads:
                f.wait()
            return out
        half = max(round_up(staging_bytes // 2, TENSOR_ALIGN), max((l.nbytes for l in locations.values()),
                                                                   default=0))
        buffers, events = [empty_pinned(round_up(half), torch.uint8) for _ in range(2)], [None, None]
        stream = cuda_copy.copy_stream(device)
        for k, batch in enumerate(_batches(items, half)):
            buf = buffers[k % 2]
            if events[k % 2] is not None:
                events[k % 2].synchronize()  # the copies out of this buffer have finished
            reads = [handle.pread(buf[off:off + loc.nbytes], loc.path, loc.offset)
                     for _, loc, off in batch if loc.nbytes]
            for f in reads:
                f.wait()
            for name, loc, off in batch:
                with cuda_copy.allocating_on_side_stream(device):
                    t = out[name] = torch.empty(loc.shape, dtype=loc.dtype, device=device)
                if loc.nbytes:
                    events[k % 2] = cuda_copy.copy_async(t.view(-1).view(torch.uint8), buf[off:off + loc.nbytes],
                                                         stream)
        current = torch.cuda.current_stream(device)
        for ev in events:
            if ev is not None:
                current.wait_event(ev)
        for t in out.values():
            t.record_stream(current)
        return out
    finally:
        if own:
            handle.close()
