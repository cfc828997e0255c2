"""Gradients of GPU-resident parameters copied to pinned host memory during backward (offload="cpu").

A post-accumulate-grad hook on each CUDA parameter queues the copy of p.grad into the parameter's place in one
pinned arena, on the device's side copy stream after the work that produced it: the copy overlaps the rest of
backward, and step() starts with the gradients already on the host (as torchao's CPUOffloadOptimizer does). p.grad
itself stays as torch leaves it, until zero_grad().

A copy is used only while p.grad is still the tensor it copied, unchanged since (same version counter): after
torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, opt.clip_grad_norm_ or any in-place edit of the gradient
after its hook ran, step() copies that gradient again (overlapped with the kernel), so the result is always the
one of the gradient as step() finds it. With gradient accumulation each backward copies the sum so far: the
last copy is the one step() uses.

on_ready(callback): callback(p) runs in the hook once p's copy is queued (optimizer-in-backward steps p then).
"""
import weakref

import torch

from ..core import cuda_copy
from ..core.pinned import empty_pinned
from .params import on_gpu, shard

_ARENA_ALIGN = 64  # each gradient at a cache-line boundary of the arena


class GradCopies:
    def __init__(self):
        self._on_ready = self._check = None
        self.places = {}   # p -> byte offset of its gradient in the arena
        self.end = 0
        self.arena = None  # pinned uint8, allocated at the first copy
        self.copied = {}   # p -> (the gradient copied, its version then, event of the copy's completion, arrival)
        self.arrivals = 0
        self._hooks = []
        # device -> event of the latest copy into the arena (each device's copies run in order on one stream):
        # kept past forget(), so that the arena is let go only after every copy into it, taken or not
        self._last = {}

    def on_ready(self, callback, check=None):
        """callback(p) (a bound method, held weakly) runs in the hook once p's copy is queued; check(p) (the same),
        before it is queued, may refuse the gradient by raising."""
        self._on_ready = weakref.WeakMethod(callback)
        self._check = weakref.WeakMethod(check) if check is not None else None

    def attach(self, params):
        """Hooks the CUDA parameters among params (each once)."""
        me = weakref.ref(self)  # the hooks live as long as the model: they must not keep the optimizer alive
        for p in params:
            t = shard(p)
            if not on_gpu(t) or p in self.places or not p.requires_grad:
                continue
            if self.arena is not None:  # the arena grows: copies into the old one are dropped (copied again)
                self.sync()
                self.arena, self.copied = None, {}
            self.places[p] = self.end
            self.end += -(-t.numel() * t.element_size() // _ARENA_ALIGN) * _ARENA_ALIGN

            def hook(param, me=me):
                copies = me()
                if copies is not None:
                    copies._copy(param)
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _host(self, p, g):
        if self.arena is None:
            self.arena = empty_pinned(max(self.end, 1), torch.uint8)
        at = self.places[p]
        return self.arena[at:at + g.numel() * g.element_size()].view(g.dtype).view(g.shape)

    def _copy(self, p):
        g = p.grad
        if g is None:
            return
        g = shard(g)
        t = shard(p)
        if g.device != t.device or g.layout != torch.strided or g.dtype != t.dtype or g.shape != t.shape:
            self.copied.pop(p, None)  # step() copies what it finds
            return
        check = self._check() if self._check is not None else None
        if check is not None:
            check(p)
        host = self._host(p, g)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(g.device))
        # after the kernels that wrote the gradient and nothing else
        # the arena is this object's; g is not held (zero_grad() frees it at once), its memory is kept from reuse
        # until the copy read it
        done = cuda_copy.copy_async(host, g, cuda_copy.copy_stream(g.device, "to_host"), wait_for=produced,
                                    hold=False)
        cuda_copy.keep_until(done, host)  # the arena lives until the copy ran, even if this object goes first
        self.arrivals += 1
        self._last[g.device] = done
        # weak: model.zero_grad() frees the gradient
        self.copied[p] = (weakref.ref(g), g._version, done, self.arrivals)
        if self._on_ready is not None:
            on_ready = self._on_ready()
            if on_ready is not None:
                on_ready(p)

    def take(self, p, g, as_copied=False):
        """p's gradient on the host (flat, valid until p's next backward) if the copy made in backward is of `g`
        as it is now, after waiting for that copy alone; else None (g changed since: copy it again).
        as_copied: the copy whatever g is now (in-backward updates use the gradient as backward produced it)."""
        entry = self.copied.get(p)
        if entry is None:
            return None
        copied, version, done, _ = entry
        g = shard(g)
        if not as_copied and (copied() is not g or g._version != version):
            return None
        done.synchronize()
        at = self.places[p]
        return self.arena[at:at + g.numel() * g.element_size()].view(g.dtype)

    def copied_as(self, p):
        """(weak ref to the gradient copied in backward, its version then), or None."""
        entry = self.copied.get(p)
        return entry[:2] if entry is not None else None

    def arrival(self, p):
        """The order in which p's gradient copy was queued in backward (step() steps the parameters whose
        gradients came first first, overlapping what is left of backward); None without a copy."""
        entry = self.copied.get(p)
        return entry[3] if entry is not None else None

    def copy_event(self, p):
        """The event of p's gradient copy (after the kernels of backward that read p's old value), or None."""
        entry = self.copied.get(p)
        return entry[2] if entry is not None else None

    def forget(self):
        """zero_grad(): no copy is of a live gradient any more."""
        self.copied = {}

    @property
    def pinned_bytes(self):
        return self.arena.numel() if self.arena is not None else 0

    def sync(self):
        """Waits for every copy into the arena (those zero_grad() forgot too), not for the devices."""
        for done in list(self._last.values()):
            done.synchronize()
        self._last = {}

    def close(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.sync()
        self.copied, self.arena = {}, None
