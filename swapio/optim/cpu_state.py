"""offload="cpu": the fp32 master and the moments live in RAM, in optimizer.state[p] as torch keeps them."""
import torch

from ..core._ranges import section
from ..core._signals import DeferredSigint
from ..core.handle import AioHandle
from ..core.pinned import empty_pinned, is_pinned
from .cuda_staging import CudaStaging, StepCopies
from .finish import finish_all
from .params import FP32, MASTER, on_gpu, shard
from .segment import init_segment, run_segment
from .timing import IoClock, now


class CpuState:
    """State tensors in `state[p]` (the optimizer's state dict) beside "step": the rule's fields, on the CPU,
    stored as the state format says (e.g. for Adam "exp_avg", "exp_avg_sq" shaped like the parameter,
    "max_exp_avg_sq" with amsgrad, "exp_avg_scale" and "exp_avg_sq_scale" with int8 state, and an fp32 "master"
    where the parameter is not itself a contiguous fp32 CPU tensor).

    fmt: the StateFormat; state: the optimizer's state dict (the same object for the optimizer's life: the
    optimizer replaces its contents, never the dict); slot_bytes: BufferBudget.slot_bytes, the size of each
    GPU staging buffer; io_settings: AioHandle settings for checkpoint handles."""

    def __init__(self, fmt, state, slot_bytes, io_settings, grad_copies=None, whole=False):
        self.format, self.state = fmt, state
        self.whole = whole  # the rule steps whole parameters (rules.Rule.whole): GPU ones are not segmented
        self.staging = CudaStaging(slot_bytes)
        self.grad_copies = grad_copies  # GradCopies: GPU parameters' gradients copied to the host in backward
        self._sent = {}  # p -> event of the last copy to the GPU straight out of p's pinned master
        self.io_settings = io_settings
        self.clock = IoClock()  # kernel time and waits for GPU copies (opt.step_report())
        self._codes = {}  # p -> {field: (data_ptr, version)} of its int8 codes as this backend last left them

    def check_process(self):
        """Nothing: the state is in this process's memory (a forked child has its own copy)."""

    def place(self, placement, group_of=None):
        """Nothing to place: a parameter's tensors are made at its first step."""

    def held_fields(self, p):
        """The state fields p's tensors hold (None: no state yet)."""
        st = self.state.get(p)
        return tuple(name for name in st if name != "step") if st else None

    def note_entry(self, p, entry):
        """Nothing: state[p] holds the arrays themselves, so putting back a copy of it restores them."""

    def replaced_entry(self, p):
        return None

    def unread_entries(self, p):
        """Nothing: state[p] holds the state tensors themselves, read at each step as torch reads them."""
        return []

    def state_misfit(self, p, t):
        """What p's state tensors hold where they do not fit a parameter like t (None where they all do)."""
        for name, x in self.state.get(p, {}).items():
            if name == "step" or not torch.is_tensor(x):
                continue
            factor = self.format.is_factor(name)
            if (factor and t.dim() < 2) or x.numel() != self.format.count(name, t.numel(), t.shape if factor else None):
                return f"holds {name} of shape {tuple(x.shape)}"
        return None

    def step(self, works, threads, ctrl_c, copies=None):
        """Steps each parameter in turn; ctrl_c.poll() between parameters, where each one is fully stepped or
        untouched. A first step's state tensors go to w.created, installed with the count (the optimizer's
        _commit). GPU parameters come first, those whose gradients came over first in backward first, so that
        their updates overlap what the GPU still computes of backward; their segments flow through pinned
        buffers (cuda_staging), the new values copied to the device while the next segment computes.
        copies: a StepCopies the caller ends (in-backward updates: at step()), else the step's own."""
        state, clock = self.state, self.clock
        own = copies is None
        copies = StepCopies() if own else copies
        arrival = self.grad_copies.arrival if self.grad_copies is not None else (lambda p: None)
        gpu = sorted((w for w in works if w.cuda), key=lambda w: (arrival(w.p) is None, arrival(w.p) or 0))
        for w in works:  # every refusal before anything is stepped, as nvme mode's place() refuses
            if not w.new:
                self._check_codes(w)
                self._check_held(w)
        try:
            for w in gpu + [w for w in works if not w.cuda]:
                if w.new:
                    stored = {name: self._empty(name, w.p) for name in w.fields}
                else:
                    stored = {name: state[w.p][name] for name in w.fields}
                fields = {name: t.view(-1) for name, t in stored.items()}
                if w.new:
                    init_segment(w, 0, w.numel, fields)
                if w.cuda:
                    self._step_on_gpu(w, fields, threads, copies)
                else:
                    t0 = now()
                    with section("swapio::kernel"):
                        run_segment(w, 0, w.numel, fields, w.grad, None, threads)
                    clock.kernel_s += now() - t0
                w.done, w.created = True, stored if w.new else None
                if self.format.has_scales:
                    self._codes[w.p] = _codes_of(stored)
                ctrl_c.poll()
        except BaseException:
            t0 = now()
            self.staging.sync()  # nothing may still copy into or out of the buffers
            clock.io_wait_s += now() - t0
            raise
        finally:
            if own:
                copies.end()

    def _check_held(self, w):
        """RuntimeError where p's state lacks a field its step needs, or holds a master it no longer needs. Which
        fields a parameter keeps follows its dtype, device and contiguity (the master), its group's options (Adam's
        amsgrad) and, for Adafactor, its number of dimensions (a vector keeps variance, a matrix its factors).
        Checked for every parameter before any is stepped: raised between two parameters, it left the ones before
        stepped and the rest not, and a step given again after the fix stepped those twice."""
        held = self.state[w.p]
        missing = [name for name in w.fields if name not in held]
        # a master held but no longer needed: a bf16 model made fp32 (model.float()) would step on from its
        # bf16-rounded values, the fp32 master dropped, silently (nvme mode refuses it at placing, as the docs say)
        unneeded = [MASTER] if torch.is_tensor(held.get(MASTER)) and MASTER not in w.fields else []
        if missing or unneeded:
            what = f"has no {missing}" if missing else f"holds a {unneeded} it no longer needs"
            raise RuntimeError(f"the state of a parameter of shape {tuple(w.t.shape)} (now {w.t.dtype} on "
                               f"{w.t.device}) {what}: its dtype, device or contiguity "
                               "(model.to(torch.bfloat16), .half(), .float() of a bf16 model, "
                               "model.to(memory_format=torch.channels_last): a "
                               "parameter that is not a contiguous fp32 CPU tensor keeps an fp32 master), its "
                               "group's amsgrad or, for OffloadAdafactor, its number of dimensions changed after its "
                               "first step; give the optimizer a new parameter instead")

    def _check_codes(self, w):
        """RuntimeError, before anything is stepped, where int8 codes in state[p] were changed or replaced since
        this backend wrote them: they are codes, not values, so torch's ways to reset a moment (zero_(), a new
        zero tensor) would set it to about -1 x its block's scale (the signed map's code 0), silently."""
        problem = self._codes_problem(w.p)
        if problem:
            raise RuntimeError(f"a parameter of shape {tuple(w.t.shape)}: {problem}; or del opt.state[p] to start its "
                               "state afresh")

    def _codes_problem(self, p):
        """Why p's int8 codes in state[p] cannot be taken (changed or replaced since this backend wrote them), or
        None. Also what state_dict() and save() check (through adopt_entry): they exported such codes as moments
        (zero_() as about -1 x the block's scale), a checkpoint a resumed run went on from silently."""
        seen = self._codes.get(p)
        st = self.state.get(p)
        if not seen or not st:  # (no entry: the parameter starts afresh)
            return None
        now_ = _codes_of({name: st[name] for name in seen if torch.is_tensor(st.get(name))})
        edited = [name for name in seen if now_.get(name) != seen[name]]
        if not edited:
            return None
        return (f"{edited[0]!r} was changed or replaced in optimizer.state[p] since its last step: with "
                "state_dtype='int8' it holds codes, not values (code 0 stands for about -1 x the block's scale, so "
                "zero_() does not zero the moment): to set moments, load_state_dict() a state dict with them in "
                "fp32")

    def adopt_entry(self, p, names):
        """Makes the arrays of `names` that the user put in state[p] what the kernel walks, as torch's step takes
        them (None where all are; else why one cannot be taken). One that is not contiguous (`opt.state[p]
        ["exp_avg"] = t`, t transposed or sliced) becomes a contiguous copy; a floating one of another dtype or
        device (`torch.zeros_like(p)`, torch's way to reset a moment, is bf16 for a bf16 parameter) becomes a copy
        stored as load_state_dict() stores it (fp32 exactly, bf16 rounded to nearest). The kernel read a bf16
        tensor as bf16 state, and save() wrote its bytes under the checksums of fp32 ones, which load() refused.
        Same values, so nothing is stepped differently from torch. int8 codes are not values: see _check_codes.
        A key of the user's own is refused: torch keeps it, while state_dict() and save() carry only `names`."""
        st = self.state.get(p) or {}
        own = [key for key in st if key != "step" and key not in names]
        if own:
            return (f"{own[0]!r} is not a field of this optimizer's state (it keeps {list(names)}), so state_dict() "
                    "and save() would leave it out: keep it outside optimizer.state")
        for name in names:
            if name not in st:
                continue
            t = st[name]
            if not torch.is_tensor(t):  # (the step failed on it with a bare TypeError, and state_dict() gave it out)
                return f"{name!r} was given a {type(t).__name__}, not a tensor: give it a floating tensor"
            want = self.format.dtype(name)
            if t.dtype == want and t.device.type == "cpu":
                if not t.is_contiguous():
                    st[name] = t.contiguous()
                continue
            if want == torch.uint8:
                return (f"{name!r} holds int8 codes (state_dtype='int8'), not values, and was given a {t.dtype} "
                        "tensor: set moments by load_state_dict() of a state dict with them in fp32")
            if not t.is_floating_point() or t.is_meta or t.is_complex():
                return (f"{name!r} was given a {t.dtype} tensor on {t.device}, which holds no real values to "
                        "step with: give it a floating tensor")
            st[name] = t.detach().to(device="cpu", dtype=want, copy=True).contiguous()
        return self._codes_problem(p)

    def _empty(self, name, p):
        """A new state array; the fp32 master of an fp32 GPU parameter in pinned memory, so that its new values go
        to the GPU straight from it, with no pass through staging."""
        t = shard(p)
        if name == MASTER and on_gpu(t) and t.dtype == FP32:
            return empty_pinned(t.shape, FP32)
        return self.format.empty(name, p)

    def _step_on_gpu(self, w, fields, threads, copies):
        fmt, clock = self.format, self.clock
        master = fields.get(MASTER)
        direct = master is not None and w.t.dtype == FP32 and w.tmp is None and is_pinned(master)
        t0 = now()
        if direct:  # the kernel is about to write the master: the last copy out of it must have finished
            sent = self._sent.pop(w.p, None)
            if sent is not None:
                sent.synchronize()
        host_grad = (self.grad_copies.take(w.p, w.grad_source, as_copied=copies.in_backward)
                     if self.grad_copies is not None else None)
        # new values go to the GPU after the kernels that read the old ones: in a step(), everything queued on the
        # compute stream before it (the program may read parameters between backward and step()); during
        # backward, the kernels before the gradient's copy
        after = self.grad_copies.copy_event(w.p) if host_grad is not None and copies.in_backward else None
        clock.io_wait_s += now() - t0
        if self.whole:
            self._step_whole_on_gpu(w, fields, threads, host_grad, direct, copies, after)
            return
        segments = self.staging.segments(w, copies, host_grad, out=not direct)
        event = None
        while True:
            t0 = now()
            got = next(segments, None)  # waits for that segment's gradient and buffer only
            clock.io_wait_s += now() - t0
            if got is None:
                break
            a, b, grad, out, i = got
            t0 = now()
            with section("swapio::kernel"):
                run_segment(w, a, b, {k: fmt.part(k, v, a, b) for k, v in fields.items()}, grad, out, threads)
            clock.kernel_s += now() - t0
            event = copies.to_device(w.dst[a:b], master[a:b] if direct else out, w.t.device, after)
            if not direct:
                self.staging.sent(i, event)
        if direct and event is not None:
            self._sent[w.p] = event
        if w.tmp is not None:  # a non-contiguous parameter: its values from the temporary, after those copies
            copies.to_device(w.t.detach(), w.tmp, w.t.device, event)

    def _step_whole_on_gpu(self, w, fields, threads, host_grad, direct, copies, after):
        """A rule that needs the whole parameter (Adafactor): the gradient comes over whole (or was copied in
        backward), the kernel runs once, the new values go back in one copy after the kernels that read the old
        ones (the gradient's copy event, else the step's start), from the pinned master or a pinned buffer of the
        parameter's dtype (held until that copy finishes)."""
        clock = self.clock
        t0 = now()
        if host_grad is None:
            host_grad = empty_pinned(w.grad.shape, w.grad.dtype)
            copies.to_host(host_grad, w.grad, w.t.device).synchronize()
        clock.io_wait_s += now() - t0
        out = None if direct else empty_pinned((w.numel,), w.t.dtype)
        t0 = now()
        with section("swapio::kernel"):
            run_segment(w, 0, w.numel, fields, host_grad, out, threads)
        clock.kernel_s += now() - t0
        event = copies.to_device(w.dst, fields[MASTER] if direct else out, w.t.device, after)
        if direct:
            self._sent[w.p] = event
        if w.tmp is not None:
            copies.to_device(w.t.detach(), w.tmp, w.t.device, event)

    def live_tensors(self, params, fields_of):
        """{p: {field: the live state tensor}} of the exported fields when they are stored as state_dict()
        exports them (fp32 state: as torch's state_dict() gives), else None (they must be decoded)."""
        if not self.format.exports_stored:
            return None
        return {p: {name: self._shaped(self.state[p][name], name, p) for name in fields_of(p)} for p in params}

    def _shaped(self, t, name, p):
        """The live tensor t shaped as field `name` of p is exported: a view where p's `.data` was replaced by one
        of the same count and another shape since t was made (Adam's state is element-wise and steps on)."""
        shape = self.format.shape(name, shard(p).shape)
        return t if t.shape == shape else t.view(shape)

    def io_handles(self):
        """(read handle, write handle, owned) for checkpoints: a new handle, closed by the caller."""
        h = AioHandle.from_config(dict(self.io_settings))
        return h, h, True

    def dump(self, params, sink):
        """sink(p, first_element, end_element, {field: view of every stored field}) for each parameter; waits the
        futures it returns."""
        futures = []
        for p in params:
            st = self.state[p]
            futures.extend(sink(p, 0, shard(p).numel(), {k: v.reshape(-1) for k, v in st.items() if k != "step"}) or ())
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
                    st[name] = self._empty(name, p)
                futures.extend(source(p, 0, shard(p).numel(), {name: st[name].view(-1) for name in fields}) or ())
        finally:
            finish_all(f.wait for f in futures)
        check()
        with DeferredSigint():  # commit() swaps the state dict's contents: a Ctrl-C halfway would empty it
            commit()
            for p in entries:
                self._codes.pop(p, None)  # the new codes are the load's

    def memory(self):
        """The bytes of the state tensors in RAM; pinned: the GPU staging buffers ("state"), and as parts of their
        own the GPU parameters' gradient copies ("gpu_grads": one arena, each gradient's size) and their fp32
        masters, pinned state ("gpu_masters", also counted in state_bytes)."""
        state = sum(t.nbytes for st in self.state.values() for k, t in st.items()
                    if k != "step" and isinstance(t, torch.Tensor))
        masters = sum(st[MASTER].nbytes for st in self.state.values()
                      if isinstance(st.get(MASTER), torch.Tensor) and is_pinned(st[MASTER]))
        grads = self.grad_copies
        parts = {"gpu_grads": {"bytes": grads.pinned_bytes if grads is not None else 0,
                               "budget": grads.end if grads is not None else 0},
                 "gpu_masters": {"bytes": masters, "budget": masters}}
        return {"state_bytes": state, "pinned_bytes": self.staging.pinned_bytes, "io_bytes_per_step": 0,
                "pinned_parts": {k: v for k, v in parts.items() if v["budget"]}}

    def close(self):
        self.staging.sync()
        for event in self._sent.values():
            event.synchronize()
        self._sent = {}


def _codes_of(stored):
    """{field: (data_ptr, version)} of the int8 codes among a parameter's state tensors."""
    return {name: (t.data_ptr(), t._version) for name, t in stored.items() if t.dtype == torch.uint8}
