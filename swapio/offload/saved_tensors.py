"""Backward through offloaded modules: autograd keeps tokens, not weights, and fetches weights again when needed.

While an offloaded module's forward runs with grad enabled, a saved-tensor hook replaces every tensor autograd
saves that lies in a fetched weight (the weight itself or a view such as W.t()) by a token: the slot, offset,
size and stride. In backward, unpacking a token fetches the record again (the ring and prefetch work as in
forward, `prefetch` units back in forward order) and rebuilds the view on a private copy, which autograd drops
after the node ran. So a forward with grad enabled holds no weight, and the memory bound holds in backward.
"""
import weakref

import torch

from .fetch import view


class _Token:
    __slots__ = ("slot", "unit", "offset", "size", "stride")

    def __init__(self, slot, unit, offset, size, stride):
        self.slot, self.unit, self.offset, self.size, self.stride = slot, unit, offset, size, stride


class SavedWeights:
    def __init__(self, streamer):
        self.streamer = streamer
        self._cache = {}  # slot -> weakref to its refetched tensor, shared by the nodes unpacking it meanwhile
        self.refetches = 0

    def enter(self, entered):
        """Installs the hooks, recorded in `entered` first: a Ctrl-C landing anywhere in here leaves a record that
        exit() can act on, and exit() tells from the hooks' stack whether the push happened."""
        entered.append(self)
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)

    def exit(self):
        """Takes the hooks enter() installed off the stack, if they are on top of it (they are not when an
        interrupt came between enter()'s record and its push)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == self.pack and top[1] == self.unpack:
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def pack(self, t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return t
        try:
            entries = self.streamer.live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if not entries:
            return t
        ptr = t.data_ptr()
        for start, end, slot, unit in entries:
            if start <= ptr < end or ptr == start:
                if t.dtype != slot.dtype or (ptr - start) % t.element_size():
                    break
                return _Token(slot, unit, (ptr - start) // t.element_size(), tuple(t.size()), tuple(t.stride()))
        return t.clone()  # in a fetched region, but not a view we can rebuild: keep a private copy

    def unpack(self, saved):
        if not isinstance(saved, _Token):
            return saved
        base = self._fetch(saved.slot, saved.unit)
        return torch.as_strided(base, saved.size, saved.stride, base.storage_offset() + saved.offset)

    def _fetch(self, slot, unit):
        ref = self._cache.get(slot)
        t = ref() if ref is not None else None
        if t is not None:
            return t
        streamer, fetcher = self.streamer, self.streamer.fetcher
        streamer.training.check_backward(slot.record)
        with fetcher.lock:
            fetch = fetcher.acquire(slot.record)
            try:
                streamer._prefetch(streamer.schedule.behind, unit)
                t = view(fetch, slot)
                if fetch.device is None and fetch.transient:
                    t = t.clone()  # the host region goes back to the ring at release
            finally:
                fetcher.release(fetch)
        self.refetches += 1
        self._cache[slot] = weakref.ref(t)
        return t
