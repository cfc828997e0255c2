"""offload="cpu": the fp32 master and the moments live in RAM, in optimizer.state[p] as torch keeps them."""
import weakref

import torch

from ..handle import AioHandle
from ..pinned import empty_pinned
from ._common import decoded_tensors, finish_all, init_segment, run_segment, shard


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
    """State tensors in optimizer.state[p] beside "step": the rule's fields, on the CPU, stored as the state
    format says (e.g. for Adam "exp_avg", "exp_avg_sq" shaped like the parameter, "max_exp_avg_sq" with amsgrad,
    "exp_avg_scale" and "exp_avg_sq_scale" with int8 state, and an fp32 "master" where the parameter is not
    itself a contiguous fp32 CPU tensor)."""

    def __init__(self, opt, slot_bytes, io_settings):
        self.opt = weakref.proxy(opt)  # no cycle: dropping the optimizer frees its files at once
        self.format = opt._rule.format
        self.staging = CudaStaging(slot_bytes)
        self.io_settings = io_settings

    def step(self, works, threads, ctrl_c):
        """Steps each parameter in turn; ctrl_c.poll() between parameters, where each one is fully stepped or
        untouched. A first step's state tensors go to w.created, installed with the count (OffloadAdam._commit)."""
        state, fmt = self.opt.state, self.format
        try:
            for w in works:
                if w.new:
                    stored = {name: fmt.empty(name, w.p) for name in w.fields}
                else:
                    st = state[w.p]
                    missing = [name for name in w.fields if name not in st]
                    if missing:
                        raise RuntimeError(f"the state of a parameter has no {missing}: its group's options "
                                           "(amsgrad) changed after its first step")
                    stored = {name: st[name] for name in w.fields}
                fields = {name: t.view(-1) for name, t in stored.items()}
                if w.new:
                    init_segment(w, 0, w.numel, fields)
                if w.cuda:
                    cap = self.staging.capacity  # a multiple of the int8 block
                    for a in range(0, w.numel, cap):
                        b = min(a + cap, w.numel)
                        i, sg, so = self.staging.acquire()
                        run_segment(w, a, b, {k: fmt.part(k, v, a, b) for k, v in fields.items()}, sg, so, threads)
                        self.staging.record(i, w.t.device)
                else:
                    run_segment(w, 0, w.numel, fields, None, None, threads)
                w.done, w.created = True, stored if w.new else None
                ctrl_c.poll()
        finally:
            self.staging.sync()

    def tensors(self, params, fields_of):
        """{p: {field: tensor}} of the exported fields: with fp32 state the live state tensors, as torch's
        state_dict() gives; with bf16 or int8 state new fp32 tensors decoded from them."""
        if self.format.name == "fp32":
            return {p: {name: self.opt.state[p][name] for name in fields_of(p)} for p in params}
        return decoded_tensors(self, self.format, params, fields_of)

    def io_handles(self):
        """(read handle, write handle, owned) for checkpoints: a new handle, closed by the caller."""
        h = AioHandle.from_config(dict(self.io_settings))
        return h, h, True

    def dump(self, params, sink):
        """sink(p, first_element, end_element, {field: view of every stored field}) for each parameter; waits the
        futures it returns."""
        futures = []
        for p in params:
            st = self.opt.state[p]
            futures.extend(sink(p, 0, shard(p).numel(), {k: v.view(-1) for k, v in st.items() if k != "step"}) or ())
        finish_all(f.wait for f in futures)

    def fill(self, entries, source, placement, state, check, commit):
        """Loads a whole new state, all or nothing: new tensors put in `state` (not the live one) are filled by
        source(p, first_element, end_element, {field: view}) (which may return futures that finish it), then
        check(), then commit() makes `state` live. entries: {p: the fields to keep}."""
        futures = []
        try:
            for p, fields in entries.items():
                st = state[p]
                for name in fields:
                    st[name] = self.format.empty(name, p)
                futures.extend(source(p, 0, shard(p).numel(), {name: st[name].view(-1) for name in fields}) or ())
        finally:
            finish_all(f.wait for f in futures)
        check()
        commit()

    def memory(self):
        """The bytes of the state tensors in RAM and of the pinned GPU staging buffers."""
        state = sum(t.nbytes for st in self.opt.state.values() for k, t in st.items()
                    if k != "step" and isinstance(t, torch.Tensor))
        staging = self.staging.capacity * 8 * self.staging.count if self.staging._buffers is not None else 0
        return {"state_bytes": state, "pinned_bytes": staging, "io_bytes_per_step": 0}

    def forget(self, p):
        pass

    def close(self):
        pass
