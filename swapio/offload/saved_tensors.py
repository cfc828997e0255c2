"""Backward through offloaded modules: autograd keeps tokens, not weights, and fetches weights again when needed.

While an offloaded module's forward runs with grad enabled, a saved-tensor hook replaces every tensor autograd
saves that lies in a fetched weight (the weight itself or a view such as W.t()) by a token: the slot, offset,
size and stride. In backward, unpacking a token fetches the record again (the ring and prefetch work as in
forward, `prefetch` units back in forward order) and rebuilds the view on the fetched region itself, which stays
out of the ring until autograd drops the unpacked weight after the node ran (no copy: a copy of an LM head was
that much heap beyond the ring's budget). So a forward with grad enabled holds no weight, and the memory bound
holds in backward.
"""
import threading
import weakref

import torch

from ..core._signals import DeferredSigint
from .fetch import view
from .kept import Kept, modified_in_place


class _Token:
    __slots__ = ("slot", "unit", "offset", "size", "stride", "rewrites")

    def __init__(self, slot, unit, offset, size, stride, rewrites):
        self.slot, self.unit, self.offset, self.size, self.stride = slot, unit, offset, size, stride
        self.rewrites = rewrites  # the slot's rewrites when saved: one since (a step) changed the weight in place


class _Delegated:
    """A saved tensor handed to the hooks below ours, with the unpack that brings it back."""
    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


class _Lower(threading.local):
    hooks = None  # per thread: the (pack, unpack) below swapio's own hooks, where non-weights go


class _Entered:
    """One push of the hooks, as recorded in a unit's hooks_entered: exit() takes it off again."""
    __slots__ = ("saved", "prev")

    def __init__(self, saved, prev):
        self.saved, self.prev = saved, prev

    def exit(self):
        """Takes the hooks off the stack, if they are on top of it (they are not when an interrupt came between
        enter()'s record and its push), and gives the hooks below back what they were before this push."""
        saved = self.saved
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == saved.pack and top[1] == saved.unpack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        saved.lower.hooks = self.prev


class SavedWeights:
    def __init__(self, streamer):
        self.streamer = streamer
        self._cache = {}  # slot -> weakref to its refetched tensor, shared by the nodes unpacking it meanwhile
        self.refetches = 0
        self.lower = _Lower()
        self._host_records = None  # storage data_ptr -> the records whose host copies it holds (cpu_offload)

    def enter(self, entered):
        """Installs the hooks, recorded in `entered` first: a Ctrl-C landing anywhere in here leaves a record that
        exit() can act on, and exit() tells from the hooks' stack whether the push happened. Saved tensors that
        are not weights go to the hooks that were on top before (activation offload, a checkpoint's), if any."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        own = top is not None and top[0] == self.pack and top[1] == self.unpack
        entered.append(_Entered(self, self.lower.hooks))
        if not own:  # nested in another unit's forward, the hooks below stay those of the outer push
            self.lower.hooks = top
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        except RuntimeError as e:  # torch's own words name neither swapio nor a way out
            if "torch.func" not in str(e):
                raise
            raise RuntimeError(
                "torch.func's grad transforms (grad, vjp, jacrev, hessian) cannot differentiate through a module "
                "offloaded by swapio: swapio fetches its weights again in backward through saved-tensor hooks, "
                "which torch.func does not support yet. Use torch.autograd.grad (create_graph=True for higher "
                "orders), or keep the module resident (keep_resident=[...]). torch.func.vmap works")

    def pack(self, t):
        token = self.token(t)
        if token is not None:
            return token
        lower = self.lower.hooks
        if lower is None or self._host_records_of(t):  # a weight's host copy is no activation to offload
            return Kept(t)  # (checked for changes in place at unpack, as autograd does without hooks)
        return _Delegated(lower[1], lower[0](t))

    def token(self, t):
        """A _Token for a tensor in a fetched weight (a private copy if it cannot be rebuilt), else None."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return None
        try:
            entries = self.streamer.live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return None
        if not entries:
            return None
        ptr = t.data_ptr()
        for start, end, slot, unit in entries:
            if start <= ptr < end or ptr == start:
                if t.dtype != slot.dtype or (ptr - start) % t.element_size():
                    break
                return _Token(slot, unit, (ptr - start) // t.element_size(), tuple(t.size()), tuple(t.stride()),
                              self.streamer.training.rewrites.get(slot, 0))
        return t.clone()  # in a fetched region, but not a view we can rebuild: keep a private copy

    def unpack(self, saved):
        if isinstance(saved, _Delegated):
            return saved.unpack(saved.packed)
        if isinstance(saved, Kept):
            try:
                return saved.unpack()
            except RuntimeError:
                self._check_host_copy(saved.tensor)
                raise
        if not isinstance(saved, _Token):
            return saved
        if self.streamer.training.rewrites.get(saved.slot, 0) != saved.rewrites:
            # as autograd refuses a parameter a step changed in place after the forward that saved it: the weights
            # fetched now would be the new ones, the activations saved with them came from the old. (An in_backward
            # update of this very graph's first backward is a second backward: check_backward says so.)
            self.streamer.training.check_backward(saved.slot.record)
            raise modified_in_place(saved.slot.dtype, saved.size,
                                    f"is a view of the offloaded weight {saved.slot.name!r}, which an optimizer "
                                    "step (or a load) rewrote since the forward that saved it")
        base = self._fetch(saved.slot, saved.unit)
        return torch.as_strided(base, saved.size, saved.stride, base.storage_offset() + saved.offset)

    def _check_host_copy(self, t):
        """A saved tensor changed in place: if it is in a record's host copy (cpu_offload computing on the CPU saves
        the weights themselves), an in_backward update that rewrote it says so (a second backward), as the weights
        fetched again do in _fetch, whichever of the two the update's progress lets the backward reach first."""
        for record in self._host_records_of(t):
            self.streamer.training.check_backward(record)

    def _host_records_of(self, t):
        """The records whose host copies share t's storage (several where they are views of one checkpoint mmap)."""
        if self._host_records is None:
            by_storage = {}
            for record, host in (self.streamer.fetcher.hosts or {}).items():
                by_storage.setdefault(host.untyped_storage().data_ptr(), []).append(record)
            self._host_records = by_storage
        if not self._host_records or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return ()
        try:
            return self._host_records.get(t.untyped_storage().data_ptr(), ())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return ()

    def _fetch(self, slot, unit):
        ref = self._cache.get(slot)
        t = ref() if ref is not None else None
        if t is not None:
            return t
        streamer, fetcher = self.streamer, self.streamer.fetcher
        streamer.training.check_backward(slot.record)
        # a Ctrl-C lands once the claim is let go of (or its alias owns it): one landing between claim() and the
        # try left the fetch counted as in use for good (every later step refused to rewrite those weights)
        with fetcher.lock, DeferredSigint():
            claim = fetcher.claim(slot.record)
            fetch = claim.fetch
            try:
                streamer._prefetch(streamer.schedule.behind, unit)
                t = view(fetch, slot)
                if fetch.device is None and fetch.transient and fetcher.is_region(fetch, t):
                    t = fetcher.hold(claim, t)  # the region goes back to the ring when autograd drops the weight
            finally:
                fetcher.let_go(claim)  # unless the alias owns it now
        self.refetches += 1
        self._cache[slot] = weakref.ref(t)
        return t
