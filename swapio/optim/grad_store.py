"""Gradients of offloaded weights, summed in fp32 next to the optimizer state until step().

torch sums a parameter's gradients over several backward passes in .grad; an offloaded weight has no .grad
(each forward makes a new leaf), so its gradients are summed here: in RAM (offload="cpu", RamGrads) or in a file
beside the state's swap file (offload="nvme", FileGrads: each parameter's fp32 sum at a 4 KiB-aligned extent,
read, added to and written back through two pinned buffers, which step() reads the sums into too). Like .grad,
the sums outlive step() until zero_grad(). clip_grad_norm_ needs each sum's norm, computed as torch computes it
for a .grad of the weight's dtype: RamGrads from RAM; FileGrads keeps the norm of each sum as it writes it, so a
clip makes no pass over the file. A clip scales each sum as torch scales a .grad in place: multiplied, then
rounded to the weight's dtype (bf16, fp16); FileGrads applies its clips' scales, one after the other, where the
sum is read next (step, the next backward's addition, or a later clip, which reads the scaled sums to take their
norms afresh).
"""
import os

import torch

from ..core._align import round_up
from ..core._in_flight import InFlight
from ..core.handle import AioHandle
from ..core.pinned import GrowingBlock
from .finish import finish_all
from .params import FP32, shard


ZEROED = "zeroed"  # FileGrads: the sum was zeroed (p.grad.zero_()); the file's bytes are stale


def _norm(t, dtype):
    """What torch.nn.utils.clip_grad_norm_ computes for a .grad of `dtype` holding t: in that dtype."""
    return torch._foreach_norm([t if dtype == FP32 else t.to(dtype)])[0]


def _clip(s, coef, dtype):
    """s *= coef, as torch's in-place mul of a .grad of `dtype`: rounded to that dtype."""
    s.mul_(coef)
    if dtype != FP32:
        s.copy_(s.to(dtype))


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
        return {p: _norm(self.sums[p], p.dtype) for p in params if p in self.sums}

    def drop(self, p):
        self.sums.pop(p, None)

    def zero(self, p):
        if p in self.sums:
            self.sums[p].zero_()

    def scale(self, coef):
        for p, s in self.sums.items():
            _clip(s, coef, p.dtype)

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
        self.held = {}      # p -> (norm of the sum as read next, or None: not known; the clips' scales to apply
                            # to the sum on disk, in order, or ZEROED)
        # Two pinned buffers, for additions in backward (one is written while the next sum is added in the other)
        # and for step()'s reads (arena 0 and 1: the next batch's sums are read while this one steps). Backward and
        # step() never overlap, so they share: gradients pin two buffers, each the larger of the largest sum and
        # the largest batch, whatever the model's depth.
        self._buffers, self._pending, self._turn = [GrowingBlock(), GrowingBlock()], [None, None], 0  # _pending: (future, p)
        self.lost = set()   # sums whose write failed: neither the old nor the new, until dropped or zeroed

    def _sized(self, k, nbytes):
        """Buffer k, grown (replaced) to hold at least nbytes; nothing may read into or write from it now."""
        return self._buffers[k].at_least(nbytes)

    def _buffer(self, nbytes):
        k = self._turn
        self._turn ^= 1
        self._finish(k)
        return k, self._sized(k, nbytes)[:round_up(nbytes)]

    def _extent(self, p, nbytes):
        off = self.extents.get(p)
        if off is None:
            off = self.extents[p] = self.end
            self.end += round_up(nbytes)
        return off

    def _finish(self, k):
        """Waits for buffer k's write; a sum whose write failed is lost (see check)."""
        pending, self._pending[k] = self._pending[k], None
        if pending is not None:
            try:
                pending[0].wait()
            except BaseException:
                self.lost.add(pending[1])
                raise

    def check(self):
        """RuntimeError while a sum is lost: stepping, clipping or adding to it would use bytes that are neither
        the old sum nor the new one."""
        if self.lost:
            raise RuntimeError(f"{len(self.lost)} gradient sum(s) could not be written to {self.path} (the OSError "
                               "raised earlier): call zero_grad() and run the backward pass again")

    def add(self, p, g):
        self.check()
        n = g.numel()
        k, buf = self._buffer(n * 4)
        s = buf[:n * 4].view(FP32).view(g.shape)
        off = self._extent(p, n * 4)
        if p in self.held and self.held[p][1] != ZEROED:
            self._wait_writes()
            self.handle.pread(buf, self.path, off).wait()
            self._apply(s, p)
            s.add_(g)
            norm = _norm(s, p.dtype)
        else:
            s.copy_(g)
            norm = _norm(g, p.dtype)  # s holds g exactly: no rounded copy of s (for an LM head, 2 bytes a weight)
        self.held[p] = (norm, [])
        self._pending[k] = (self.handle.pwrite(buf, self.path, off), p)

    def _apply(self, s, p):
        """The pending clips of p (or its zeroing) applied to s, its sum as read from the file."""
        scales = self.held[p][1]
        if scales == ZEROED:
            s.zero_()
            return
        for coef in scales:
            _clip(s, coef, p.dtype)

    def _wait_writes(self):
        finish_all(lambda k=k: self._finish(k) for k in range(len(self._pending)))

    def has(self, p):
        return p in self.held

    def start_reads(self, params, arena=0):
        """Starts reading the sums of params (a batch) into read arena `arena` (0 or 1: the next batch is read
        while this one steps), up to 32 reads in flight at once; returns a callable that waits and gives {p: sum,
        its clip scale applied}, views valid until the arena's next start_reads or the next add()."""
        self._wait_writes()
        self.check()
        sizes = [round_up(shard(p).numel() * 4) for p in params]
        buf = self._sized(arena, sum(sizes))
        views, futures, at, in_flight = {}, [], 0, InFlight()  # (each read holds the file open until done)
        try:
            for p, size in zip(params, sizes):
                futures.append(in_flight.submit(
                    lambda: self.handle.pread(buf[at:at + size], self.path, self.extents[p])))
                views[p] = buf[at:at + shard(p).numel() * 4].view(FP32).view(shard(p).shape)
                at += size
        except BaseException:  # none still reads into the arena once the error propagates
            finish_all(f.exception for f in futures)
            raise

        def result():
            finish_all(f.wait for f in futures)
            for p, v in views.items():
                self._apply(v, p)
            return views
        return result

    def norms(self, params):
        """The norms kept; those a clip made unknown are taken afresh from the scaled sums (a pass over them, one
        sum at a time: a norm scaled by the clip's factor may differ from torch's in the last bit)."""
        self._wait_writes()
        self.check()
        for p in params:
            if p in self.held and self.held[p][0] is None:
                v = self.start_reads([p], 0)()[p]
                self.held[p] = (_norm(v, p.dtype), self.held[p][1])
        return {p: self.held[p][0] for p in params if p in self.held}

    def drop(self, p):
        self.held.pop(p, None)  # its extent stays, for its next sum
        self.lost.discard(p)

    def zero(self, p):
        if p in self.held:
            self.held[p] = (_norm(torch.zeros(()), p.dtype), ZEROED)
            self.lost.discard(p)

    def scale(self, coef):
        for p, (norm, scales) in self.held.items():
            if scales != ZEROED:
                self.held[p] = (None, scales + [coef])

    def clear(self):
        try:
            self._wait_writes()
        except OSError:
            pass  # a write of a sum dropped now: nothing of it is needed any more
        self.held = {}  # extents stay: the next sums overwrite them
        self.lost = set()

    def close(self):
        try:
            self._wait_writes()
        finally:
            self.handle.close()

    def nbytes(self):
        return self.end

    def pinned_bytes(self):
        return sum(b.nbytes for b in self._buffers)
