"""Gradients of offloaded weights, summed in fp32 next to the optimizer state until step().

torch sums a parameter's gradients over several backward passes in .grad; an offloaded weight has no .grad
(each forward makes a new leaf), so its gradients are summed here: in RAM (offload="cpu", RamGrads) or in a file
beside the state's swap file (offload="nvme", FileGrads: each parameter's fp32 sum at a 4 KiB-aligned extent,
read, added to and written back through two pinned buffers, which step() reads the sums into too). Like .grad,
the sums outlive step() until
zero_grad(). clip_grad_norm_ needs each sum's norm: RamGrads computes it from RAM, FileGrads keeps the norm
of each sum as it writes it, so clipping makes no pass over the file; the clip's scale is applied where the sum
is read next (step, or the next backward's addition).
"""
import os

import torch

from ..core._align import round_up
from ..core.handle import AioHandle
from ..core.pinned import empty_pinned
from .finish import finish_all
from .params import FP32, shard


def _norm(t):
    return torch._foreach_norm([t])[0]  # what torch.nn.utils.clip_grad_norm_ computes per gradient


class RamGrads:
    def __init__(self):
        self.sums = {}  # p -> fp32 tensor shaped like p

    def add(self, p, g):
        s = self.sums.get(p)
        if s is None:
            self.sums[p] = g.to(FP32, copy=True)
        else:
            s.add_(g)

    def has(self, p):
        return p in self.sums

    def start_reads(self, params, arena=0):
        """A callable giving {p: sum} for params (all in RAM: nothing to read)."""
        return lambda: {p: self.sums[p] for p in params}

    def norms(self, params):
        return {p: _norm(self.sums[p]) for p in params if p in self.sums}

    def drop(self, p):
        self.sums.pop(p, None)

    def scale(self, coef):
        for s in self.sums.values():
            s.mul_(coef)

    def clear(self):
        self.sums = {}

    def close(self):
        self.sums = {}

    def nbytes(self):
        return sum(s.nbytes for s in self.sums.values())

    def pinned_bytes(self):
        return 0


class FileGrads:
    """fp32 sums in `directory`/grads.swap (the optimizer's private swap directory)."""

    def __init__(self, directory, io_settings):
        self.path = os.path.join(directory, "grads.swap")
        self.handle = AioHandle.from_config(dict(io_settings))
        self.extents = {}   # p -> byte offset in the file
        self.end = 0
        self.held = {}      # p -> (norm of the sum on disk, pending clip scale or None)
        # Two pinned buffers, for additions in backward (one is written while the next sum is added in the other)
        # and for step()'s reads (arena 0 and 1: the next batch's sums are read while this one steps). Backward and
        # step() never overlap, so they share: gradients pin two buffers, each the larger of the largest sum and
        # the largest batch, whatever the model's depth.
        self._buffers, self._pending, self._turn = [None, None], [None, None], 0

    def _sized(self, k, nbytes):
        """Buffer k, grown (replaced) to hold at least nbytes; nothing may read into or write from it now."""
        if self._buffers[k] is None or self._buffers[k].numel() < nbytes:
            self._buffers[k] = None
            self._buffers[k] = empty_pinned(round_up(max(nbytes, 1)), torch.uint8)
        return self._buffers[k]

    def _buffer(self, nbytes):
        k = self._turn
        self._turn ^= 1
        pending, self._pending[k] = self._pending[k], None
        if pending is not None:
            pending.wait()
        return k, self._sized(k, nbytes)[:round_up(nbytes)]

    def _extent(self, p, nbytes):
        off = self.extents.get(p)
        if off is None:
            off = self.extents[p] = self.end
            self.end += round_up(nbytes)
        return off

    def add(self, p, g):
        n = g.numel()
        k, buf = self._buffer(n * 4)
        s = buf[:n * 4].view(FP32).view(g.shape)
        off = self._extent(p, n * 4)
        if p in self.held:
            self._wait_writes()
            self.handle.pread(buf, self.path, off).wait()
            scale = self.held[p][1]
            if scale is not None:
                s.mul_(scale)
            s.add_(g)
        else:
            s.copy_(g)
        self.held[p] = (_norm(s), None)
        self._pending[k] = self.handle.pwrite(buf, self.path, off)

    def _wait_writes(self):
        for k, f in enumerate(self._pending):
            self._pending[k] = None
            if f is not None:
                f.wait()

    def has(self, p):
        return p in self.held

    def start_reads(self, params, arena=0):
        """Starts reading the sums of params (a batch) into read arena `arena` (0 or 1: the next batch is read
        while this one steps), all reads in flight at once; returns a callable that waits and gives {p: sum,
        its clip scale applied}, views valid until the arena's next start_reads or the next add()."""
        self._wait_writes()
        sizes = [round_up(shard(p).numel() * 4) for p in params]
        buf = self._sized(arena, sum(sizes))
        views, futures, at = {}, [], 0
        for p, size in zip(params, sizes):
            futures.append(self.handle.pread(buf[at:at + size], self.path, self.extents[p]))
            views[p] = buf[at:at + shard(p).numel() * 4].view(FP32).view(shard(p).shape)
            at += size

        def result():
            finish_all(f.wait for f in futures)
            for p, v in views.items():
                scale = self.held[p][1]
                if scale is not None:
                    v.mul_(scale)
            return views
        return result

    def norms(self, params):
        return {p: self.held[p][0] for p in params if p in self.held}

    def drop(self, p):
        self.held.pop(p, None)  # its extent stays, for its next sum

    def scale(self, coef):
        for p, (norm, scale) in self.held.items():
            self.held[p] = (norm * coef, coef if scale is None else scale * coef)

    def clear(self):
        self._wait_writes()
        self.held = {}  # extents stay: the next sums overwrite them

    def close(self):
        try:
            self._wait_writes()
        finally:
            self.handle.close()

    def nbytes(self):
        return self.end

    def pinned_bytes(self):
        return sum(b.numel() for b in self._buffers if b is not None)
