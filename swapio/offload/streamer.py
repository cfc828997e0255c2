"""WeightStreamer: puts a unit's weights in place just before its forward and takes them away after.

Entering (OffloadedForward wraps the module's forward): fetch the unit's records (already on their way if
predicted), start the next `prefetch` units' fetches, and point the module's attributes at the fetched tensors.
Leaving (however the forward ended, Ctrl-C included): point them back at the meta placeholders and release the
records, so their memory is reused for the next fetches. Weights are only reachable while their module's forward
runs; outputs that are views of them are copied out first, and autograd saves them as tokens that fetch them
again in backward (see saved_tensors.py).
"""
import contextlib
import os
import sys
import threading
import time
import weakref

import torch

from ..core._fork_lock import ForkAwareLock
from ..core._ranges import section
from ..core._signals import DeferredSigint
from . import compiled, conversions, graph_capture, loading, onload, saved_tensors, saving
from .data_parallel import WrappedForwardCheck
from .fetch import view
from .no_copy import refuse_copy
from .read_ahead import ReadAhead
from .schedule import Schedule
from .training import Training
from .units import (FORWARD, check_entries, check_placeholders, install_placeholders, move_to, refuse_meta_inputs,
                    set_entry)

NO_OWN_FORWARD = object()  # a module without a forward of its own in its __dict__ (the usual case)


@compiled.runs_eagerly
class OffloadedForward:
    """An offloaded module's forward: its weights are put in place, the module's own forward runs, and they are
    taken away again, whatever ends the call. A wrapper rather than forward hooks, because torch runs
    always_call hooks after an Exception only: a KeyboardInterrupt would leave the module holding its ring
    region and the saved-tensor hooks installed. The unit's lock lets one thread at a time run the module
    (a module's weights are attributes shared by every caller); threads pipeline through the model module by
    module. A copy of the model would run the original's hooks on meta tensors, so copying is refused."""

    __slots__ = ("streamer", "unit", "inner", "module", "__weakref__")

    def __init__(self, streamer, unit, inner, module=None):
        self.streamer, self.unit, self.inner = streamer, unit, inner
        self.module = unit.module if module is None else module

    def unbound(self, args):
        """The call's arguments without the module itself, where something bound this wrapper to its module:
        accelerate's unwrap_model(keep_fp32_wrapper=False) binds the innermost forward it unwraps (this, for a
        root module that is offloaded) with MethodType, which passes the module first."""
        return args[1:] if args and args[0] is self.module else args

    def pass_through(self):
        """After remove_offload: calls run the module's forward as it was. Something may still call this wrapper:
        one installed over it since (accelerate's prepare wraps the model's forward in autocast), which stays,
        or a reference kept (accelerate's model._original_forward, which unwrap_model binds again)."""
        self.streamer = self.unit = None

    @property
    def __wrapped__(self):  # inspect.signature(module.forward) shows the module's own (generate() inspects it)
        return self.inner

    @property
    def __code__(self):  # torch.export reads it before it calls the forward (which then refuses: graph_capture)
        return self.inner.__code__

    def __call__(self, *args, **kwargs):
        args = self.unbound(args)
        unit, streamer = self.unit, self.streamer
        if streamer is None:
            return self.inner(*args, **kwargs)
        graph_capture.refuse_capture()
        refuse_meta_inputs(args, kwargs, streamer.device)
        return streamer.counted_call(self, lambda: self._timed(unit, streamer, args, kwargs), args, kwargs)

    def _timed(self, unit, streamer, args, kwargs):
        nested = unit.lock._is_owned()  # this thread runs the module already (a recursive call)
        outer, start = streamer.outer, None
        try:
            if not outer.inside:  # the thread's outermost offloaded forward: nested ones are inside its time
                start = time.perf_counter()  # set before `inside`, so that an interrupt after it still resets it
                outer.inside = True
            return self._run(unit, streamer, nested, args, kwargs)
        finally:
            if start is not None:
                outer.inside = False
                streamer.forward_ends(start)

    def _run(self, unit, streamer, nested, args, kwargs):
        with unit.lock:
            if not nested and (unit.depth or unit.fetches or unit.hooks_entered):
                # a Ctrl-C that landed inside enter() or leave() themselves left some of the last call's state
                # behind: nobody runs the module now, so it is stale
                unit.depth = 1
                streamer.leave(unit, None)
            try:
                streamer.enter(unit)
                output = self.inner(*args, **kwargs)
            except BaseException:
                streamer.leave(unit, None)
                raise
            return streamer.leave(unit, output, finished=True)

    def __reduce_ex__(self, protocol):
        refuse_copy()

    __deepcopy__ = __copy__ = lambda self, *memo: self.__reduce_ex__(None)


class _Outer(threading.local):
    inside = False  # every thread starts outside any offloaded forward


class WeightStreamer:
    def __init__(self, model, units, slots, records, fetcher, device, prefetch, store, dressings=()):
        self.model, self.units, self.slots, self.records = model, units, slots, records
        self.dressings = tuple(dressings)  # modules whose install(model) / uninstall(model) attach and detach run
        self.fetcher, self.device, self.prefetch = fetcher, device, prefetch
        self.schedule = Schedule(units)
        self.read_ahead = {}  # walk (Schedule.ahead, .behind) -> its ReadAhead (read_ahead.py), made at first use
        self.handles = []
        self.guarded = weakref.WeakSet()  # modules given an instance _apply or __prepare_scriptable__ (detach: off)
        self._check_wrapper = WrappedForwardCheck(model, slots)  # DDP around the model: data_parallel.py
        self.live = {}  # id(storage data_ptr) -> [(start, end, slot, unit)] of weights materialized right now
        self.saved = saved_tensors.SavedWeights(self)
        self.extra_close = []  # callables run by close() (handles to close, directories to give up)
        self.outer = _Outer()  # per thread: inside an offloaded forward already (stats' forward_s)
        # offloaded forwards running now, in any thread; remove_offload refuses while there are any, and new ones
        # are refused while it runs (it takes the weights out from under them: a closed handle, placeholders put
        # back into a model it had made resident)
        self._calls_lock, self._calls, self._removing = ForkAwareLock("this offloaded model", FORWARD), set(), False
        self._threads = set()  # the threads that ran forwards (up to two: see leave's kept-weight check)
        self.training = Training(self, store)  # trainable weights: gradients out, new weights in (training.py)
        self.extra_close.append(store.close)
        self._finalizer = weakref.finalize(self, _close, fetcher, self.extra_close, os.getpid())

    # ---- hooks ----------------------------------------------------------------------------------------------
    def attach(self):
        """Allocates the ring, wraps each unit's forward and installs the placeholders. On any failure (Ctrl-C
        included) the model is left as it was: no wrapper, its own tensors in place (the caller's `current`)."""
        try:
            self.fetcher.prepare(self.records)
            for unit in self.units:
                unit.own_forward = unit.module.__dict__.get("forward", NO_OWN_FORWARD)
                wrapper = OffloadedForward(self, unit, unit.module.forward)
                unit.wrapper = weakref.ref(wrapper)  # weakly, as the unit holds its module (see units.Unit)
                unit.module.forward = wrapper
            inputs = self._move_inputs if self.device.type != "cpu" else self._check_inputs
            self.handles.append(self.model.register_forward_pre_hook(inputs, with_kwargs=True))
            install_placeholders(self.units)
            conversions.install(self)
            graph_capture.install(self)
            loading.install(self)
            saving.install(self)
            for dressing in self.dressings:
                dressing.install(self.model)
            self.training.register(self.slots)
        except BaseException:
            self.detach()
            raise

    def _check_inputs(self, module, args, kwargs):
        self._check_wrapper(module)
        refuse_meta_inputs(args, kwargs, self.device)  # (each offloaded module checks its own inputs too)

    def _move_inputs(self, module, args, kwargs):
        self._check_wrapper(module)
        refuse_meta_inputs(args, kwargs, self.device)
        move = move_to(self.device)
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    # ---- time (stats: forward_s, wait_s) ------------------------------------------------------------------------
    def counted_call(self, wrapper, body, args, kwargs):
        """body() as an offloaded forward counted as running (see _calls); wrapper.inner(*args, **kwargs) where
        remove_offload has finished since the wrapper read its streamer (the weights are resident). The call's
        token is made before the try, so that its finally gives it back whatever point a Ctrl-C lands at."""
        call = (threading.get_ident(), object())
        try:
            if not self.begin_call(wrapper, call):
                return wrapper.inner(*args, **kwargs)
            return body()
        finally:
            self.end_call(call)

    def begin_call(self, wrapper, call):
        """An offloaded module's forward begins (see _calls): True, or False where remove_offload has finished
        since the wrapper read its streamer. (A count incremented here and not decremented, a Ctrl-C landing as
        this returned, kept remove_offload refused for good: counted_call's finally always gives `call` back.)"""
        with self._calls_lock:
            if self._removing:
                if wrapper.streamer is None:
                    return False
                raise RuntimeError("a forward of a model that remove_offload(model) is putting back to resident "
                                   "weights in another thread: call the model after remove_offload has returned")
            self._calls.add(call)
            if len(self._threads) < 2:
                self._threads.add(call[0])
            return True

    def _one_thread(self):
        """Whether every forward of this model so far ran in one thread."""
        return len(self._threads) <= 1

    def end_call(self, call):
        """(Any number of times, begun or not.)"""
        with self._calls_lock:
            self._calls.discard(call)

    def begin_removal(self):
        """remove_offload begins: refused while forwards run (see _calls); end_removal(False) if it fails."""
        with self._calls_lock:
            if self._calls:
                raise RuntimeError(
                    "remove_offload(model) while the model runs a forward (in another thread: a generate() in "
                    "progress, say, or from inside the model's own forward): it would take the weights out from "
                    "under it. Call remove_offload when the model's calls have returned")
            self._removing = True

    def end_removal(self):
        with self._calls_lock:
            self._removing = False

    def forward_ends(self, start):
        """The thread's outermost offloaded forward, begun at perf_counter() `start`, has ended."""
        elapsed = time.perf_counter() - start
        with self.fetcher.lock:
            self.fetcher.stats["forward_s"] += elapsed

    def enter(self, unit):
        """Fetches the unit's weights and puts them in place. On failure the caller (OffloadedForward) leaves."""
        if not unit.depth:  # before depth counts it: leave() then puts nothing back (a weight taken out stays out)
            self.fetcher.check_process()
            check_entries((unit,), forward=True)
        unit.depth += 1
        if unit.depth > 1:
            return
        self.training.settle()  # updates an optimizer still runs from the last backward (in_backward) come first
        with section("swapio::fetch"):
            self._fetch_in(unit)

    def _fetch_in(self, unit):
        with outside_func_transforms():
            grad = self._put_weights_in(unit)
        if grad:  # inside them: torch refuses the hooks under torch.func's grad transforms (saved_tensors.py says so)
            self.saved.enter(unit.hooks_entered)

    def _put_weights_in(self, unit):
        """Fetches the unit's weights and puts them in its attributes; whether grad mode is on."""
        unit.buffers_in.clear()  # what an interrupted leave() left
        check_placeholders(slot for _, _, slot in unit.entries)
        self.schedule.observe(unit)
        fetcher = self.fetcher
        for record in unit.records:
            fetcher.start(record, required=True)
        self._prefetch(self.schedule.ahead, unit)
        fetcher.pump()
        t0 = time.perf_counter()
        try:
            # a Ctrl-C lands once each fetch is in unit.fetches, which leave() gives back: one landing between
            # acquire() and the append left the fetch counted as in use for good (every later step refused to
            # rewrite those weights). (It waits at most for this module's reads.)
            with DeferredSigint():
                for record in unit.records:
                    unit.fetches.append(fetcher.acquire(record))
        finally:  # the forward waits here for its weights: reads (and for CUDA, issuing their copies)
            waited = time.perf_counter() - t0
            with fetcher.lock:
                fetcher.stats["wait_s"] += waited
        by_record = {f.record: f for f in unit.fetches}
        grad = torch.is_grad_enabled()
        for attr, kind, slot in unit.entries:
            fetch = by_record[slot.record]
            t = view(fetch, slot)
            if fetch.transient:
                start = t.data_ptr()
                with self.fetcher.lock:  # shared by the threads running other modules
                    self.live.setdefault(t.untyped_storage().data_ptr(), []).append(
                        (start, start + slot.nbytes, slot, unit))
            if kind == "param":
                t = torch.nn.Parameter(t, requires_grad=slot.requires_grad)
                if slot.requires_grad and grad:
                    self.training.watch(slot, t)
                if fetch.transient and fetch.device is None:
                    unit.lent.append((slot, weakref.ref(t)))
            else:
                unit.buffers_in.append((attr, slot, t, self._snapshot(unit, fetch, t)))
            set_entry(unit.module, attr, kind, t)
        return grad

    def _prefetch(self, walk, unit):
        """Starts fetches ahead along `walk` (schedule.ahead, or .behind in backward): the next `prefetch` units,
        then, for disk reads, as many more as the ring has room for. Reading ahead by bytes keeps the disk busy
        through modules that compute faster than they read (a decode step) and through stalls of the computing
        thread; the ring bounds it, and read_ahead.WALK_UNITS the units one walk reaches. Units with less than
        read_ahead.SMALL bytes (norms, biases) ride along without counting. What the last module's call started is
        remembered and extended (read_ahead.py), not walked again at every module.
        When the ring is full, reads ahead that this walk does not reach yet are dropped to make room (the next
        forward's first modules, read ahead at the end of a forward, when backward starts instead); then it
        stops at the first record the ring has no room for. For CUDA only the first `prefetch` units are copied
        to the device ahead; the rest wait in the ring, so device memory holds no more than before."""
        if not self.prefetch:
            return
        key = getattr(walk, "__func__", walk)
        with self.fetcher.lock:  # (the frontiers are shared by the threads running modules)
            frontier = self.read_ahead.get(key)
            if frontier is None:
                frontier = self.read_ahead[key] = ReadAhead(self.fetcher, self.schedule, self.prefetch)
            frontier(walk, unit)

    def _snapshot(self, unit, fetch, t):
        """The buffer's bytes before the forward, where a change in place would be lost: in memory reused after
        the forward (the ring, a device copy). Taken in train mode (BatchNorm's running statistics), and always on
        the CPU, where comparing costs no device synchronization."""
        if not fetch.transient or not (unit.module.training or self.device.type == "cpu"):
            return None
        return t.detach().reshape(-1).view(torch.uint8).clone() if t.numel() else None

    def _changed_buffer(self, unit):
        """(name, how) of an offloaded buffer the module's forward changed, whose change the next fetch would not
        see (it reads the stored bytes again), or None."""
        module = unit.module
        for attr, slot, t, before in unit.buffers_in:
            if module._buffers.get(attr) is not t:
                return slot.name, "assigned again"
            if before is not None and not torch.equal(t.detach().reshape(-1).view(torch.uint8), before):
                return slot.name, "changed in place"
        return None

    def leave(self, unit, output, finished=False):
        if unit.depth == 0:
            return output
        unit.depth -= 1
        if unit.depth > 0:
            return output
        changed = self._changed_buffer(unit) if finished else None
        unit.buffers_in.clear()
        while unit.hooks_entered:
            unit.hooks_entered[-1].exit()
            unit.hooks_entered.pop()
        copied = False
        if output is not None and any(f.transient and f.device is None for f in unit.fetches):
            output, copied = self._copy_escaping(output, unit.fetches)
        for attr, kind, slot in unit.entries:
            set_entry(unit.module, attr, kind, slot.placeholder)
        # (an output that was a view of the weights is referenced by the caller until it gets the copy)
        # (only for a model that one thread runs: another's forwards and backwards hold references to the weights
        # too, which the count cannot tell from a kept one)
        referenced = _kept_weight(unit) if finished and not copied and self._one_thread() else None
        unit.lent.clear()
        with self.fetcher.lock:
            for key in [k for k, v in self.live.items() if any(u is unit for _, _, _, u in v)]:
                kept = [e for e in self.live[key] if e[3] is not unit]
                if kept:
                    self.live[key] = kept
                else:
                    del self.live[key]
        while unit.fetches:  # one at a time: an interrupted leave() leaves the rest for the next call to release
            self.fetcher.release(unit.fetches.pop())
        self.fetcher.pump()
        if referenced is not None:
            raise RuntimeError(
                f"{referenced} is offloaded by swapio, and something still references the tensor that "
                f"{type(unit.module).__name__}'s forward computed with (a custom torch.autograd.Function keeping it "
                "as `ctx.weight = weight` for its backward, a module or closure caching it): that memory is reused "
                "for other weights as soon as the forward returns, so whatever reads it later (the backward) would "
                "read other bytes. Save tensors a backward needs with ctx.save_for_backward(...), which swapio "
                f"fetches again for the backward, or keep the module resident (keep_resident=[{unit.name!r}])")
        if changed is not None:  # accelerate drops such a change silently; a wrong model later is worse
            name, how = changed
            raise RuntimeError(
                f"{name} is an offloaded buffer that {type(unit.module).__name__}'s forward {how} (BatchNorm's "
                "running statistics in train mode, a cache): the change would be lost, since the next forward "
                "fetches the stored buffer again. Offload with offload_buffers=False (buffers stay resident, the "
                f"default){', ' if unit.module.training else ' or '}keep_resident=[{unit.name!r}]"
                + (", or run the module in eval mode" if unit.module.training else ""))  # eval: changes it anyway
        return output

    @staticmethod
    def _copy_escaping(output, fetches):
        """Outputs that are views of the unit's host regions (a module returning a slice of its weight) are
        copied: the region is reused once the unit is released. Returns (output, whether anything was copied)."""
        storages = {f.host.untyped_storage().data_ptr() for f in fetches if f.host is not None}
        copied = []

        def fix(x):
            if isinstance(x, torch.Tensor):
                if x.device.type == "cpu" and _storage_ptr(x) in storages:
                    copied.append(True)
                    return x.clone()
                return x
            if isinstance(x, tuple) and not hasattr(x, "_fields"):
                return tuple(fix(v) for v in x)
            if isinstance(x, list):
                return [fix(v) for v in x]
            if isinstance(x, dict):
                for k in list(x.keys()):
                    v = x[k]
                    nv = fix(v)
                    if nv is not v:
                        x[k] = nv
                return x
            return x
        output = fix(output)
        return output, bool(copied)

    # ---- teardown -------------------------------------------------------------------------------------------
    def detach(self):
        """Removes swapio's wrappers and hooks (idempotent); the module's own forward is back. Handles go first:
        preload's wrappers (preload.py) sit on top of the units' own."""
        for h in reversed(self.handles):
            h.remove()
        self.handles = []
        self.training.unregister(self.slots)
        conversions.uninstall(self)
        graph_capture.uninstall(self)
        loading.uninstall(self)
        onload.remove(self.units)
        saving.uninstall(self)
        for dressing in self.dressings:
            dressing.uninstall(self.model)
        for unit in self.units:
            own, ref = getattr(unit, "own_forward", None), getattr(unit, "wrapper", None)
            if own is None or unit.module is None:  # (not wrapped, or replaced in the model and collected)
                unit.own_forward = unit.wrapper = None
                continue
            wrapper = ref() if ref is not None else None
            if wrapper is not None:
                wrapper.pass_through()
            if unit.module.__dict__.get("forward") is not wrapper:
                pass  # wrapped again since it was offloaded (accelerate's autocast): that stays, and calls ours
            elif own is NO_OWN_FORWARD:
                unit.module.__dict__.pop("forward", None)
            else:
                unit.module.forward = own
            unit.own_forward = unit.wrapper = None

    def materialize(self):
        """{slot: resident copy on the execution device} of every offloaded tensor; installs nothing, so that an
        interrupted or failing remove_offload leaves the model offloaded and working."""
        resident = {}
        for i, record in enumerate(self.records):
            for later in self.records[i + 1:i + 1 + self.prefetch]:
                if self.fetcher.start(later) is None:
                    break
            with DeferredSigint():  # a Ctrl-C lands once the fetch is released (see _put_weights_in)
                fetch = self.fetcher.acquire(record)
                try:
                    for slot in record.slots:
                        t = view(fetch, slot)
                        if slot.layout is not None:  # the offloaded tensor's strides, not the stored order's
                            t = torch.empty_like(slot.layout, device=t.device).copy_(t)
                        elif fetch.transient:
                            t = t.clone()
                        resident[slot] = (torch.nn.Parameter(t, requires_grad=slot.requires_grad) if slot.is_param
                                          else t)
                finally:
                    self.fetcher.release(fetch)
        return resident

    def install(self, resident):
        """Points every offloaded attribute at resident[slot] (ties kept: one object per slot)."""
        for unit in self.units:
            if unit.module is None:
                continue  # replaced in the model and collected since
            for attr, kind, slot in unit.entries:
                set_entry(unit.module, attr, kind, resident[slot])

    def close(self):
        """Waits for every read and copy in flight, frees the buffers and runs extra_close (once)."""
        with DeferredSigint():  # the finalizer runs once: a Ctrl-C is raised when it is done
            self._finalizer()


def _close(fetcher, extra_close, pid):
    """streamer.close(), also run when an streamer is collected without remove_offload: reads still in flight into
    the ring are waited for before the ring's memory can go (the finalizer holds the fetcher until then). In a
    fork child (its interpreter's exit runs this too) nothing: the reads, handles and files are the parent's, and
    waiting for them could block on a lock another thread of the parent held at the fork."""
    if os.getpid() != pid:
        extra_close.clear()
        return
    with DeferredSigint():  # it runs once: a Ctrl-C is raised when all of it is done, never left half done
        fetcher.drain()
        errors = []
        for fn in extra_close:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - run every cleanup, report the first failure
                errors.append(exc)
        extra_close.clear()
        if errors:
            raise errors[0]


def _storage_ptr(x):
    """The data_ptr of the storage under `x`, through torch.func's wrappers (vmap's batched tensors, grad's), which
    have no storage of their own ("Cannot access storage of BatchedTensorImpl")."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x.untyped_storage().data_ptr()


def outside_func_transforms():
    """A context in which tensors are made as plain tensors even inside torch.func's transforms (jacfwd, vmap),
    which otherwise wrap every tensor made under them, the ring's slices that reads land in too ("Cannot access
    storage of TensorWrapper"). The fetched weights are then constants of the transform, as a resident module's
    weights are."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return contextlib.nullcontext()
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    return temporarily_clear_interpreter_stack()


def _kept_weight(unit):
    """The name of a weight fetched into reused host memory (the ring, the spare) that something still references
    after its module's forward, or None. The fetched Parameter's own references are its Python object's (a
    second while C++ holds it too), for a trainable one autograd's AccumulateGrad, and torch's RNNs' list of their
    weights (refreshed by their next forward); any other, a Python reference (`ctx.weight = weight`) or a view
    kept (`ctx.wt = weight.t()`), would read the region after the ring reused it. An alias sharing only the
    memory (`weight.detach()`, `.data`: the ring's storage, which every weight's view shares) is not seen."""
    listed = unit.module.__dict__.get("_flat_weights") or ()
    for slot, ref in unit.lent:
        t = ref()
        if t is None:
            continue
        owners = t._use_count()
        python = sys.getrefcount(t) - 2 - (owners > 1) - sum(w is t for w in listed)  # less this frame's and the call's
        if python > 0 or owners > 1 + t.requires_grad:
            return slot.name
    return None
