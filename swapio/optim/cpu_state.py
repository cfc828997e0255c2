"""offload="cpu": the fp32 master and the moments live in RAM, in optimizer.state[p] as torch keeps them."""
import weakref

import torch

from ..handle import AioHandle
from ..pinned import empty_pinned
from ._common import FP32, finish_all, init_segment, run_segment


class CudaStaging:
    """A few pinned buffers in rotation for gradients coming from and parameters going to a GPU. A buffer is
    reused only after the copies queued from it have finished (a CUDA event per buffer)."""

    def __init__(self, slot_bytes, count=2):
        self.slot_bytes, self.count = slot_bytes, count
        self._buffers = None
        self._events = [[] for _ in range(count)]
        self._next = 0

    @property
    def capacity(self):
        """Elements per buffer pair (gradient in, parameter out, each up to 4 bytes an element)."""
        return max(1024, self.slot_bytes // 8 // 1024 * 1024)

    def acquire(self):
        if self._buffers is None:
            self._buffers = [empty_pinned(self.capacity * 8, torch.uint8) for _ in range(self.count)]
        i = self._next
        self._next = (i + 1) % self.count
        self.sync(i)
        buf = self._buffers[i]
        half = self.capacity * 4
        return i, buf[:half], buf[half:]

    def record(self, i, device):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._events[i].append(ev)

    def sync(self, i=None):
        for j in range(self.count) if i is None else (i,):
            for ev in self._events[j]:
                ev.synchronize()
            self._events[j] = []


class CpuState:
    """State tensors in optimizer.state[p] beside "step": the rule's fields (fp32, the parameter's shape, on the
    CPU), e.g. for Adam "exp_avg", "exp_avg_sq", "max_exp_avg_sq" with amsgrad, and "master" where the
    parameter is not itself a contiguous fp32 CPU tensor."""

    def __init__(self, opt, slot_bytes, io_settings):
        self.opt = weakref.proxy(opt)  # no cycle: dropping the optimizer frees its files at once
        self.staging = CudaStaging(slot_bytes)
        self.io_settings = io_settings

    def step(self, works, threads):
        state = self.opt.state
        for w in works:
            st = state[w.p]
            if w.new:
                for name in w.fields:
                    st[name] = torch.empty(w.p.shape, dtype=FP32)
            else:
                missing = [name for name in w.fields if name not in st]
                if missing:
                    raise RuntimeError(f"the state of a parameter has no {missing}: its group's options (amsgrad) "
                                       "changed after its first step")
            fields = {name: st[name].view(-1) for name in w.fields}
            if w.new:
                init_segment(w, 0, w.numel, fields)
            if not w.cuda:
                run_segment(w, 0, w.numel, fields, None, None, threads)
                continue
            cap = self.staging.capacity
            for a in range(0, w.numel, cap):
                b = min(a + cap, w.numel)
                i, sg, so = self.staging.acquire()
                run_segment(w, a, b, {k: v[a:b] for k, v in fields.items()}, sg, so, threads)
                self.staging.record(i, w.p.device)
        self.staging.sync()

    def tensors(self, params, fields_of):
        """{p: {field: tensor}} of the exported fields: the live state tensors, as torch's state_dict() gives."""
        return {p: {name: self.opt.state[p][name] for name in fields_of(p)} for p in params}

    def io_handles(self):
        """(read handle, write handle, owned) for checkpoints: a new handle, closed by the caller."""
        h = AioHandle.from_config(dict(self.io_settings))
        return h, h, True

    def dump(self, params, fields_of, sink):
        """sink(p, field, first_element, fp32 view) for every exported field; waits the futures it returns."""
        futures = []
        for p in params:
            st = self.opt.state[p]
            for name in fields_of(p):
                f = sink(p, name, 0, st[name].view(-1))
                if f is not None:
                    futures.append(f)
        for f in futures:
            f.wait()

    def fill(self, entries, source, placement, state, check, commit):
        """Loads a whole new state, all or nothing: reads into new tensors put in `state` (not the live one),
        then check(), then commit() makes `state` live. entries: {p: (fields, set of fields the source has)}.
        source(p, field, first, view) fills the view (or returns a future that does); a missing master is taken
        from the parameter."""
        futures = []
        try:
            for p, (fields, available) in entries.items():
                st = state[p]
                for name in fields:
                    t = torch.empty(p.shape, dtype=FP32)
                    st[name] = t
                    if name in available:
                        f = source(p, name, 0, t.view(-1))
                        if f is not None:
                            futures.append(f)
                    else:  # "master" only (the caller checked the rest)
                        t.copy_(p.detach())
        finally:
            finish_all(f.wait for f in futures)
        check()
        commit()

    def forget(self, p):
        pass

    def close(self):
        pass
