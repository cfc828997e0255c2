"""OffloadOptimizer: the base of swapio's offloaded optimizers, rule-agnostic.

A subclass is an update rule (swapio.optim.rules: which state a parameter keeps, how it steps, its
hyperparameters) plus a constructor that packs its defaults; OffloadAdam, OffloadAdamW and OffloadLion are
exactly that. This class holds what the family shares: torch.optim.Optimizer's protocol, the offload options,
the state backend (cpu_state.CpuState or nvme_state.NvmeState), step(), state dicts and streaming checkpoints
(both through state_transfer), memory_report() and the lifetime.

The step is split so that an update can be driven from outside step(): _step_params(params, grad_of) steps the
given parameters with the gradients grad_of(p) returns (step() passes every parameter and p.grad), with the
same Ctrl-C atomicity, counting and warnings. See docs/optim.md, "Design".
"""
import contextlib
import numbers
import os
import warnings
import weakref

import torch
from torch.optim import Optimizer
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from ..core._errors import SwapioWarning, check_bool, check_int, check_progress
from ..core._fork_lock import ForkAwareLock
from ..core._ranges import section
from . import checkpoint, reference, state_dict_hooks, timing, validate
from .cpu_state import CpuState
from .finish import finish_all
from ..core._signals import DeferredSigint
from ..offload.compiled import methods_run_eagerly
from .gpu_in_backward import GpuInBackward, check_unclaimed
from .grad_copies import GradCopies
from .nvme_state import NvmeState, unread_entries_message
from .offloaded import OffloadedParams
from .options import BufferBudget, io_settings
from .params import FP32, PARAM_DTYPES, shard
from .work import Work


def _unsupported(p, offloaded=False):
    """Why a parameter cannot be stepped (its dtype, device or layout), or None. offloaded: p is the placeholder of
    a weight offloaded by swapio.offload (on meta, with its weight's dtype), whose storage is swapio's."""
    if p.dtype not in PARAM_DTYPES:
        return f"dtype {p.dtype} (supported: float32, bfloat16, float16)"
    if offloaded:
        return None
    if p.device.type not in ("cpu", "cuda"):
        return f"device {p.device} (supported: cpu, cuda, and weights offloaded by swapio.offload)"
    if p.layout != torch.strided:
        return f"layout {p.layout} (only dense parameters)"
    return None


def _check_betas_kind(betas):
    """torch's rule: betas are both numbers or both tensors."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        return
    if isinstance(beta1, torch.Tensor) != isinstance(beta2, torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")


def _betas_kept(betas, hyper):
    """The betas a param group keeps: tensors as given (a 1-element one as a 0-dimensional view, as torch keeps
    them), since the step reads them at each step and torch follows an in-place change (betas[0].fill_(0.95));
    numbers as Python floats."""
    beta1, beta2 = betas
    if isinstance(beta1, torch.Tensor):  # both are (_check_betas_kind)
        return tuple(b.squeeze() if b.dim() else b for b in (beta1, beta2))
    return hyper["beta1"], hyper["beta2"]


from .reference import REFERENCE_KEY  # noqa: E402,F401  (where the Trainer integration and older code import it)


# torch.compile(opt.step), or a compiled training step that calls it: dynamo traced into the step's Python, broke
# the graph at each native call and recompiled at each new step count (13-18 s for 20 steps of a tiny model, with
# a page of warnings) to run it as eagerly in the end. It runs eagerly from the start; fullgraph=True says why.
_EAGER_STEP = ("an offloaded optimizer's step runs eagerly: it updates its state in native code on the CPU, in RAM "
               "or in swap files, which a graph cannot hold; compile without fullgraph=True (the numbers equal eager)")


# The same for what else works on the state or the gradients swapio holds (torch's own state_dict,
# load_state_dict, zero_grad and add_param_group are dynamo-disabled too): traced, clip_grad_norm_ failed on an
# offloaded weight's gradient marker ("storage_offset() on p.grad of the offloaded weight").
_EAGER_STATE = ("an offloaded optimizer's gradients, state and checkpoints are handled eagerly, in native code on "
                "the CPU, in RAM or in swap files, which a graph cannot hold; compile without fullgraph=True")


@methods_run_eagerly("_step", reason=_EAGER_STEP)
@methods_run_eagerly("zero_grad", "clip_grad_norm_", "state_dict", "load_state_dict", "add_param_group", "save",
                     "load", reason=_EAGER_STATE)
class OffloadOptimizer(Optimizer):
    """The base of OffloadAdam, OffloadAdamW and OffloadLion (see OffloadAdam for the arguments): optimizer state
    off the GPU, in RAM (offload="cpu") or in a swap file (offload="nvme"), stepped on the CPU.

    Subclasses set `_rule_type` (swapio.optim.rules), `_group_keys` (what every param group holds),
    `_historical_defaults` (keys older torch state dicts may lack) and `_decoupled`, and call
    `super().__init__(params, defaults, **offload_options)` from their own constructor."""

    _rule_type = None
    _group_keys = ()
    _historical_defaults = {}
    _decoupled = False  # every group's decoupled_weight_decay is forced True (AdamW)

    def __init__(self, params, defaults, *, offload=None, swap_dir=None, buffer_bytes=256 << 20, buffer_count=4,
                 cpu_threads=None, io_config=None, state_dtype="fp32", io_kwargs=None, in_backward=False):
        if self._rule_type is None:
            raise TypeError("OffloadOptimizer is the base of OffloadAdam, OffloadAdamW, OffloadLion and "
                            "OffloadAdafactor: build one of those (or a subclass that sets _rule_type)")
        self._rule = self._rule_type(state_dtype)  # ValueError for an unknown state_dtype
        if "betas" in defaults:
            _check_betas_kind(defaults["betas"])
        hyper = self._rule.hyper(defaults)  # validates, as torch's constructors do
        if "betas" in defaults:
            defaults["betas"] = _betas_kept(defaults["betas"], hyper)
        if offload is None:  # a swap_dir alone means the state goes there (it was ignored, the state kept in RAM)
            offload = "cpu" if swap_dir is None else "nvme"
        if offload not in ("cpu", "nvme"):
            raise ValueError(f'offload must be "cpu" or "nvme", got {offload!r}')
        budget = BufferBudget(buffer_bytes, buffer_count)
        if cpu_threads is not None:
            cpu_threads = check_int("cpu_threads", cpu_threads, 1)
        self._io = io_settings(io_config, io_kwargs or {}, type(self).__name__)
        self.offload, self.buffer_bytes, self.buffer_count = offload, budget.total, budget.count
        self.cpu_threads = cpu_threads
        self._backend = None
        self._written = {}  # p -> (version, data_ptr) after this optimizer's last write of p
        self._warned_edit = False
        self._warned_unstepped = False  # zero_grad() warned of updates in backward that no step() followed
        self._torn = set()  # parameters an error inside step() left half-stepped (see _check_whole)
        # in_backward: param group index -> [(the options (rule.options) an update run before step() used, [(p, weak
        # reference to the p.grad it stepped)])], so that step() can refuse options changed since
        # (_check_hyper_unchanged)
        self._hyper_used = {}
        self._installs = 0  # states installed by loads (install_state), so that a failed load knows if it took
        # One user of the state at a time: a step, an export, a save or a load. A thread that checkpoints
        # (state_dict(), save()) while the training thread steps shares the nvme pipeline's slots and its record
        # of the writes that finished, which would mark the step's parameters half-stepped, or write back a
        # record holding the other's data; in cpu mode it would save a state half of the old step, half of the
        # new. Held only around work on the state, never while waiting for the in_backward workers (which take
        # it to step). Reentrant: load_state_dict() of a reference calls load().
        self._state_lock = ForkAwareLock(f"this {type(self).__name__}")  # (usable in a fork child)
        self._last_step = self._step_total = None  # step_report()
        # weights of swapio-offloaded models (offloaded.py), updated in batches (one pass of the state pipeline
        # each). The step is held weakly but for in_backward work in flight, as for GpuInBackward (worker.HeldStep):
        # the models' hooks reach OffloadedParams, which must not keep the optimizer alive.
        self._offloaded = OffloadedParams(self._step_offloaded, in_backward, budget.batch_bytes)
        # cpu mode: GPU parameters' gradients leave for pinned RAM during backward (nvme mode keeps RAM bounded by
        # its buffers, so its gradients come over segment by segment in step())
        self._grad_copies = GradCopies() if offload == "cpu" else None
        self._gpu_in_backward = None
        if in_backward and offload == "cpu":
            # held weakly but for work in flight: the hooks on the model reach the worker, which must not keep the
            # optimizer alive once its updates are done
            self._gpu_in_backward = GpuInBackward(self._step_in_backward, self._grad_copies.copied_as)
            self._grad_copies.on_ready(self._gpu_in_backward.gradient_ready, self._gpu_in_backward.check_fresh)
        super().__init__(params, defaults)
        state_dict_hooks.register(self)
        if self._gpu_in_backward is not None:
            self._gpu_in_backward.state = self.state
        self._offloaded.state = self.state
        fmt = self._rule.format
        # The backends get the format, the state dict and their budget, never the optimizer: no cycle, so
        # dropping the optimizer frees its files at once. self.state stays this dict object (__setstate__).
        if offload == "nvme":
            self._backend = NvmeState(fmt, self.state, swap_dir, budget, self._io, whole=self._rule.whole)
        else:
            self._backend = CpuState(fmt, self.state, budget.slot_bytes, self._io, self._grad_copies,
                                     whole=self._rule.whole)
        try:
            self._offloaded.start(offload, self._backend, self._io)
        except BaseException:
            self.close()
            raise

    # ---- torch.optim.Optimizer protocol ------------------------------------------------------------------------
    def __setstate__(self, state):
        """Also what load_state_dict ends with: a group from an older torch that lacks a key gets torch's historical
        default for it (as torch.optim.Adam/AdamW fill it), not this optimizer's constructor argument. The state
        dict's contents are replaced, not the dict, which the backend holds."""
        live = self.__dict__.get("state")
        super().__setstate__(state)  # (torch's: self.__dict__.update, not through __setattr__)
        if live is not None and self.__dict__["state"] is not live:
            new = self.__dict__["state"]
            self.__dict__["state"] = live
            live.clear()
            live.update(new)
        for group in self.param_groups:
            for key, value in self._historical_defaults.items():
                group.setdefault(key, value)
            self._fill_group(group)

    def __setattr__(self, name, value):
        """`opt.state = defaultdict(dict)` (a common way to reset an optimizer) replaces the contents of the state
        dict, not the dict: the backend and the in-backward workers hold it, and would go on reading the old
        state while the optimizer filled the new one."""
        live = self.__dict__.get("state")
        if name == "state" and live is not None and value is not live:
            new = dict(value)  # (value may be a view of live's own contents)
            live.clear()
            live.update(new)
            return
        super().__setattr__(name, value)

    @property
    def _updates_gpu_in_backward(self):
        """Whether backward updates GPU parameters of this optimizer (in_backward=True, offload="cpu", parameters
        that were on a GPU when they were given to it): then nothing may change their gradients after backward."""
        copies = self.__dict__.get("_grad_copies")
        return self.__dict__.get("_gpu_in_backward") is not None and bool(copies.places)

    @property
    def _step_supports_amp_scaling(self):
        """What torch.amp.GradScaler asks before its step(): True makes it call step() even when it found an inf or
        NaN (its found_inf then set on the optimizer), instead of skipping it. With in_backward=True and GPU
        parameters, backward has already updated them with the scaled gradients, so a skipped step was silently
        not skipped (NaN weights while the scaler backed off, never calling step() to be refused): now step() is
        always reached, and refuses the scaler (_refuse_grad_scaler)."""
        return self._updates_gpu_in_backward

    def _refuse_grad_scaler(self):
        """RuntimeError when GradScaler.step() called step() (it set found_inf: _step_supports_amp_scaling)."""
        if "found_inf" not in self.__dict__:
            return
        del self.__dict__["found_inf"]  # (GradScaler deletes them only after a step() that returned)
        self.__dict__.pop("grad_scale", None)
        raise RuntimeError(f"torch.amp.GradScaler cannot drive this {type(self).__name__}: it has in_backward=True, "
                           "so backward already updated its GPU parameters with the scaled gradients, before the "
                           "scaler could unscale them or skip a step whose gradients hold an inf or NaN (those "
                           "updates stay: restore the weights from a checkpoint). Build the optimizer with "
                           "in_backward=False to use a GradScaler, or train with "
                           "torch.autocast(dtype=torch.bfloat16), which needs no loss scaling")

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a {type(self).__name__} cannot be copied or pickled (copy.deepcopy, pickle, torch.save of "
                        "the optimizer object): its state lives in a backend of RAM buffers or swap files that a "
                        "copy would not own. Save opt.state_dict() (torch's format) or opt.save(dir), and build a "
                        "new optimizer that load_state_dict()s or load()s it.")

    def _fill_group(self, group):
        for key in self._group_keys:
            group.setdefault(key, self.defaults[key])
        if self._decoupled:
            group["decoupled_weight_decay"] = True
        self._rule.hyper(group)  # a group's options must suit the state format (amsgrad with int8)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if len({id(p) for p in group["params"]}) != len(group["params"]):
            # torch steps such a parameter once per listing (and warns that this will be an error); the backends
            # keep one state per parameter, so stepping it twice would mix up its state with its neighbours'
            self.param_groups.pop()
            twice = sorted({i for i, p in enumerate(group["params"])
                            if any(q is p for q in group["params"][:i])})
            raise ValueError(f"a param group lists a parameter more than once (at positions {twice}); "
                             f"{type(self).__name__} steps each parameter once: list each one once")
        for i, p in enumerate(group["params"]):
            p = group["params"][i] = self._offloaded.placeholder_for(p)
            # an offloaded weight: the optimizer keeps its master, the storage its compute copy (a trainable one of
            # another dtype is refused below, as a resident one: a complex one's imaginary part was dropped)
            if p.device.type == "meta" and (p.dtype in PARAM_DTYPES or not p.requires_grad) \
                    and self._offloaded.adopt(p):
                continue
            local = shard(p)  # a DTensor (FSDP2) is stepped through its local shard
            if local is not p and self._rule.whole and p.requires_grad:  # (a frozen one is taken, as below)
                self.param_groups.pop()
                raise ValueError(f"{type(self).__name__} steps each parameter whole (its norm and row/column means "
                                 "are over all of it), but a DTensor parameter (FSDP2, tensor parallelism) holds "
                                 "only its shard here: the update would differ from torch's. Give it the full "
                                 "parameters (no fully_shard), or use OffloadAdamW, which is element-wise")
            problem = _unsupported(local)
            if problem is not None and p.requires_grad:
                self.param_groups.pop()
                raise ValueError(f"{type(self).__name__} cannot optimize a parameter with {problem}")
            # a frozen one is taken, as torch's optimizers take it (model.parameters() with a bitsandbytes int8 or
            # a float64 weight in it), and never stepped; step() refuses it if it gets a gradient
        resident = [p for p in group["params"] if p not in self._offloaded.entries]
        try:
            self._fill_group(group)
            first = sum(len(g["params"]) for g in self.param_groups[:-1])
            check_unclaimed(resident, lambda p: first + next(i for i, q in enumerate(group["params"]) if q is p),
                            type(self).__name__, self.__dict__.get("_gpu_in_backward"))
        except BaseException:
            self.param_groups.pop()
            raise
        if self.__dict__.get("_grad_copies") is not None:
            self._grad_copies.attach(resident)

    # torch's hook registration, keeping this optimizer's state-dict hooks where they must run
    # (state_dict_hooks.keep_in_place): the user's see the whole state, as with torch
    def register_state_dict_post_hook(self, hook, prepend=False):
        handle = super().register_state_dict_post_hook(hook, prepend)
        state_dict_hooks.keep_in_place(self)
        return handle

    def register_load_state_dict_pre_hook(self, hook, prepend=False):
        handle = super().register_load_state_dict_pre_hook(hook, prepend)
        state_dict_hooks.keep_in_place(self)
        return handle

    def register_load_state_dict_post_hook(self, hook, prepend=False):
        handle = super().register_load_state_dict_post_hook(hook, prepend)
        state_dict_hooks.keep_in_place(self)
        return handle

    @staticmethod
    def _process_value_according_to_param_policy(param, value, param_id, param_groups, key=None):
        """torch casts floating state to the parameter's dtype and device (for a bf16 parameter that would
        round the fp32 moments); here every state tensor becomes an fp32 CPU copy and `step` an fp32 scalar.
        (torch's load_state_dict calls the base class's policy by name, so state_dict_hooks applies this one.)"""
        if isinstance(value, torch.Tensor):
            value = shard(value)  # torch's AdamW over FSDP2 keeps DTensor state: its local shard is this rank's
        if key == "step":
            return (value.detach().to(device="cpu", dtype=FP32, copy=True) if isinstance(value, torch.Tensor)
                    else torch.tensor(float(value), dtype=FP32))
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().to(device="cpu", dtype=FP32, copy=True).contiguous()
        return value

    def _check_open(self):
        if self._backend is None:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def _settle(self):
        """Waits for the updates the in_backward workers still run (backward returns before the last ones end), so
        that the state read or replaced is whole: GPU parameters' and offloaded weights' (state_dict() missed
        them, and load_state_dict()'s state was overwritten by them). Their errors stay for step()."""
        if self._gpu_in_backward is not None:
            self._gpu_in_backward.idle()
        self._offloaded.worker.idle()

    def _check_whole(self):
        """RuntimeError while an error inside step() has left a parameter half-stepped (one spanning several nvme
        chunks, stopped between them): its state is neither the old nor the new, so stepping, exporting or
        saving it would spread the damage. load() or load_state_dict() of a checkpoint makes it whole again."""
        self._check_open()
        self._backend.check_process()  # nvme: a forked child must not touch the parent's swap file
        if self._torn:
            index = {id(p): i for i, (p, _) in enumerate(self.param_fields())}
            torn = sorted(index.get(id(p), -1) for p in self._torn)
            raise RuntimeError(f"parameter(s) {torn} of this {type(self).__name__} were left half-stepped by an "
                               "error inside step() (their state is neither the old nor the new one): load a "
                               "checkpoint with load() or load_state_dict() before stepping, exporting or saving")

    def _check_fields(self):
        """RuntimeError where a group now asks for state its parameters do not hold: amsgrad turned on after their
        first step (torch's own step fails there with a KeyError, and its state has no running maximum to give).
        Raised by state_dict() and save() naming the way back, rather than a bare KeyError from the export.
        Also where an entry of optimizer.state holds arrays the backend does not read (_check_entry), and where a
        parameter is listed twice (_check_listed_once)."""
        self._check_listed_once()
        index = -1
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1
                self._check_entry(p, index)
                if self.state.get(p):
                    self._check_fits(p, index, shard(p))
                held = self._backend.held_fields(p) if self.state.get(p) else None
                missing = [] if held is None else [f for f in self._rule.fields(p, group) if f not in held]
                if missing:
                    raise RuntimeError(f"param group {i} asks for {missing}, which the state of its parameters, made "
                                       "at their first step, does not hold: its amsgrad was turned on after that "
                                       "(OffloadAdafactor: the parameter's number of dimensions changed). Set it "
                                       "back to False to step, export or save; a run with amsgrad needs it from the "
                                       "start")

    def _check_fits(self, p, index, t):
        """ValueError where p's state does not fit a parameter like t: p's `.data` replaced by a tensor of another
        size after its first step, or (cpu mode) a moment of another size put in optimizer.state[p]. Stepping
        would read and write state it does not own; state_dict() failed on a bare reshape error, and save() wrote
        a checkpoint whose checksums load() refused."""
        misfit = self._backend.state_misfit(p, t)
        if misfit:
            raise ValueError(f"parameter {index} of this {type(self).__name__} (now of shape {tuple(t.shape)}) no "
                             f"longer fits its state, which {misfit}: its `.data` was replaced by a tensor of "
                             "another size after its first step, or a state tensor of another size was put in "
                             "optimizer.state[p]; give the optimizer a new parameter instead, or load a checkpoint "
                             "made for this shape")

    def _check_listed_once(self):
        """ValueError where a parameter is listed twice across the param groups: add_param_group refuses that, but
        an edit of a group's list (`opt.param_groups[0]["params"].append(p)`) does not pass there. torch's
        optimizers step such a parameter once per listing; the backends keep one state per parameter."""
        seen = {}
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                first = seen.setdefault(id(p), (i, j))
                if first != (i, j):
                    raise ValueError(f"param group {i} lists at position {j} a parameter already listed (group "
                                     f"{first[0]}, position {first[1]}), after an edit of optimizer.param_groups: "
                                     f"{type(self).__name__} steps each parameter once, so list each one once")

    def _check_entry(self, p, index):
        """RuntimeError where state[p] holds arrays the backend never reads (nvme mode, `opt.state[p] = {...,
        "exp_avg": t}`), or was replaced by an entry with another count (nvme mode, a copy of opt.state put back
        to roll back): stepping or exporting would use the swap file's arrays while opt.state[p] implies others.
        In cpu mode, arrays put there are first made what the kernel walks (CpuState.adopt_entry), or refused."""
        problem = self._backend.adopt_entry(p, self._rule.STATE_KEYS)
        if problem:
            raise RuntimeError(f"parameter {index} of this {type(self).__name__}: its entry in optimizer.state: "
                               f"{problem}; or del opt.state[p] to start the parameter afresh")
        unread = self._backend.unread_entries(p)
        if unread:
            raise RuntimeError(f"parameter {index} of this {type(self).__name__}: "
                               + unread_entries_message(unread, where="its entry in optimizer.state"))
        replaced = self._backend.replaced_entry(p)
        if replaced:
            held = (f"its moments in the swap file are those of step {replaced[0]:g}" if replaced[0] is not None
                    else "the swap file holds no state for it")
            raise RuntimeError(f"parameter {index} of this {type(self).__name__}: its entry in optimizer.state was "
                               f"replaced by one counting {replaced[1]:g} steps, while {held}. In nvme mode "
                               "optimizer.state holds only the counts, so putting back a copy of it does not "
                               "restore the moments: roll back with load_state_dict() of a state_dict() (or load() "
                               "of a save()) taken then, or del opt.state[p] to start the parameter afresh")

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self, closure=None):
        """One step for every parameter with a gradient; returns closure's loss when given."""
        return self._step(closure)  # (looked up at each call: run eagerly under torch.compile, whenever it came)

    @torch.no_grad()
    def _step(self, closure):
        self._check_open()
        self._answer_in_backward_updates()
        self._refuse_grad_scaler()
        self._offloaded.wait()  # an update in backward (in_backward) that failed reports its own error first
        self._check_whole()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_hyper_unchanged()
        self._check_frozen_grads()
        try:
            self._offloaded.finish()  # offloaded weights: what backward left (in_backward) or their summed gradients
            offloaded = self._offloaded.entries  # their p.grad only marks that a sum exists
            # GPU parameters updated during backward (in_backward) are skipped: their step is done
            done = self._gpu_in_backward.finish() if self._gpu_in_backward is not None else ()
            self._step_params(None, lambda p: None if p in offloaded or p in done else p.grad)
        finally:
            self._hyper_used.clear()
        return loss

    def _check_steppable(self, p, index, offloaded=False):
        """ValueError for a parameter taken frozen (add_param_group), or put in a group by an edit, that cannot be
        stepped and has a gradient."""
        problem = _unsupported(shard(p), offloaded)
        if problem is None and self._rule.whole and shard(p) is not p:
            problem = (f"only its shard here (a DTensor: FSDP2, tensor parallelism), while {type(self).__name__} "
                       "steps each parameter whole")
        if problem is not None:
            raise ValueError(f"parameter {index} of this {type(self).__name__} has a gradient, but it was taken "
                             "frozen (or put in param_groups by an edit, which add_param_group would have refused) "
                             f"and cannot be stepped: it has {problem}. Leave it frozen, or give the optimizer "
                             "parameters it can step")

    def _check_frozen_grads(self):
        """_check_steppable for every parameter with a gradient, before step() updates the offloaded weights (which
        come before the resident ones): a refusal then leaves everything unstepped."""
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    self._check_steppable(p, index, offloaded=p in self._offloaded.entries)

    def _check_hyper_unchanged(self):
        """RuntimeError, before step() steps anything more, where a group's options (lr, betas, weight decay...)
        changed after in_backward=True's updates used them: torch's step() would use the new ones for every
        parameter, but those updates ran during backward (or while backward's last updates were still running when
        the options changed, some with each). Raised until the options are set back or zero_grad()."""
        if self._gpu_in_backward is not None:
            self._gpu_in_backward.idle()  # the updates still running record theirs (the offloaded ones: wait() did)
        for i, used in sorted(self._hyper_used.items()):
            if i >= len(self.param_groups):
                continue
            try:
                now = self._rule.options(self.param_groups[i])
            except (TypeError, ValueError):
                continue  # the step below raises it, naming the group
            for old, grads in used:
                changed = [k for k in now if old.get(k) != now[k]]
                # updates whose p.grad is gone since (model.zero_grad() after a failed backward) are history
                if changed and any(g() is not None and p.grad is g() for p, g in grads):
                    what = ", ".join(f"{k} {old.get(k)!r} -> {now[k]!r}" for k in changed)
                    raise RuntimeError(f"param group {i}'s options changed after in_backward=True updated its "
                                       f"parameters with them during backward ({what}): torch's step() would use "
                                       "the new values for every parameter, but those updates have run. Change "
                                       "options before backward (call an lr scheduler's step() after opt.step()), "
                                       "or build the optimizer with in_backward=False; set them back to step, or "
                                       "zero_grad() to go on")

    def _step_offloaded(self, params, grad_of, data_of):
        """OffloadedParams' updates (in step(), or on its worker during backward): offloaded weights stepped into
        the memory data_of(p) gives, the compute-dtype copy their record is rewritten from."""
        self._check_whole()  # an earlier update (in backward) failed half way: nothing more until a load
        self._step_params(params, grad_of, data_of)

    def _step_in_backward(self, params, copies):
        """GpuInBackward's worker: steps GPU parameters whose gradients are complete, during backward."""
        with torch.no_grad():
            self._step_params(params, self._gpu_in_backward.gradient_of, copies=copies)

    def _answer_in_backward_updates(self):
        """step() (even one that raises) or a load answers the updates backward ran (in_backward): a zero_grad()
        after it is the way on that its errors name, not a step skipped silently (the warning in zero_grad())."""
        self._offloaded.answered = True
        if self._gpu_in_backward is not None:
            self._gpu_in_backward.answered = True

    def zero_grad(self, set_to_none=True):
        """torch's zero_grad for resident parameters; offloaded weights' gradient sums are dropped (zeroed with
        set_to_none=False, as torch zeroes .grad)."""
        unstepped = self._offloaded.zero_grad(set_to_none)
        if self._gpu_in_backward is not None:
            unstepped = self._gpu_in_backward.forget() or unstepped
        if unstepped and not self._warned_unstepped:
            self._warned_unstepped = True  # once per optimizer
            warnings.warn(f"zero_grad() without step() after a backward whose updates this {type(self).__name__} "
                          "(in_backward=True) had already applied: they stay. A step cannot be skipped after "
                          "backward (a non-finite loss found then), and another loss's backward that reaches these "
                          "parameters (a GAN's generator loss through its discriminator) updates them too. Decide "
                          "before backward, keep them out of other backwards (requires_grad_(False)), or build the "
                          "optimizer with in_backward=False", SwapioWarning, stacklevel=2)
        self._hyper_used.clear()  # the updates of backward are history
        if self._grad_copies is not None:
            self._grad_copies.forget()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, parameters=None):
        """torch.nn.utils.clip_grad_norm_ over every gradient this optimizer owns (resident parameters' .grad and
        offloaded weights' sums), computed as torch computes it; scales them by min(1, max_norm / (norm + 1e-6)),
        applied to the offloaded sums where they are read next. Returns the total norm. Only the 2-norm. Not with
        in_backward=True: each update runs before the last gradient exists (docs/offload.md, "Training").
        parameters: the parameters torch's clip_grad_norm_ would be given (model.parameters()), in their order,
        instead of this optimizer's in param-group order: the norms are summed in that order, so the total has
        the bits torch's gives (the groups Trainer builds, decay then no-decay, are another order). It must name
        every offloaded weight holding a gradient sum (their sums are scaled together)."""
        self._check_open()
        if self._offloaded.in_backward:
            raise RuntimeError(f"clip_grad_norm_ needs every gradient before any update, but this "
                               f"{type(self).__name__} has in_backward=True and updates each module during backward; "
                               "build it with in_backward=False (gradients summed until step()) to clip")
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_ supports norm_type=2 only, got {norm_type!r}")
        if not isinstance(max_norm, (numbers.Real, torch.Tensor)):  # (a str failed later: "unsupported operand")
            raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
        offloaded = self._offloaded.norms()
        entries = self._offloaded.entries
        if parameters is None:
            params = [p for g in self.param_groups for p in g["params"]]
        else:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            named = set(params)
            left = [p for p in offloaded if p not in named]
            if left:
                raise ValueError(f"clip_grad_norm_(parameters=...) leaves out {len(left)} offloaded weight(s) that "
                                 "hold a gradient sum; their sums are scaled together: pass every parameter "
                                 "(model.parameters()) or none")
        listed = [p for p in params if (p in offloaded) or (p not in entries and p.grad is not None)]
        if not listed:
            return torch.tensor(0.0)
        resident = [p.grad for p in listed if p not in entries]
        # as torch: the gradients grouped by device and dtype (an offloaded weight's where a resident one's would
        # be), each group's norms taken together, stacked group after group in the order of torch's grouping (not
        # the parameters' order: a reduction in another order may round differently)
        like = [torch.empty(0, dtype=offloaded[p].dtype, device=self._offloaded.device_of(p)) if p in entries
                else p.grad for p in listed]
        norms = []
        for indices in (ix for _, (_, ix) in _group_tensors_by_device_and_dtype([like], with_indices=True).items()):
            grads = [listed[i].grad for i in indices if listed[i] not in entries]
            group_norms = iter(torch._foreach_norm(grads) if grads else ())
            norms += [offloaded[listed[i]] if listed[i] in entries else next(group_norms).to("cpu") for i in indices]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                               "cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for device in {g.device for g in resident}:
            torch._foreach_mul_([g for g in resident if g.device == device], coef.to(device))
        self._offloaded.grads.scale(coef)
        return total

    def is_offloaded(self, p):
        """Whether p is the placeholder of a weight offloaded by swapio.offload that this optimizer trains."""
        return p in self._offloaded.entries

    def param_value(self, p):
        """p's current value: the parameter itself, or for an offloaded weight a copy read from its storage."""
        if p in self._offloaded.entries:
            self._settle()  # in_backward: the value after the updates backward began, not whichever ran yet
            return self._offloaded.current(p)
        return shard(p).detach()

    def _offloaded_checksum(self, p):
        """The checksum of an offloaded weight's param_value(p), read again only after a rewrite of its record."""
        self._settle()
        return self._offloaded.checksum(p)

    def _step_params(self, params, grad_of, data_of=None, copies=None):
        """Steps `params` (None: every parameter; else an iterable of this optimizer's parameters) with the
        gradients grad_of(p) gives (None: p is skipped), all or nothing per parameter. The seam for updates
        driven from outside step(): optimizer-in-backward stepping a module's parameters once their gradients
        are complete, gradients accumulated somewhere other than p.grad. data_of(p): for an offloaded weight, the
        CPU tensor that holds its current compute-dtype value and receives the new one (else None). copies: the
        StepCopies GPU parameters' copies go on when the caller ends it (cpu mode; else the step's own)."""
        with self._state_lock:
            self._check_open()  # close() from another thread may have come first
            self._step_params_locked(params, grad_of, data_of, copies)

    def _step_params_locked(self, params, grad_of, data_of, copies):
        works, nonfinite = self._works(params, grad_of, data_of)
        if not works:
            return
        clock = self._backend.clock
        before, t0 = clock.snapshot(), timing.now()
        with DeferredSigint() as ctrl_c:
            try:
                with section("swapio::step"):
                    # parameters seen for the first time get their place
                    stepped = {w.p for w in works}
                    self._backend.place(self._placed(self.param_fields(), stepped), self._offloaded.group_of)
                    if copies is None:
                        self._backend.step(works, self._threads(), ctrl_c)
                    else:
                        self._backend.step(works, self._threads(), ctrl_c, copies)
            finally:  # also when interrupted: the parameters fully stepped get their new count
                self._commit(works)
                self._last_step = timing.figures(timing.now() - t0, 1, before, clock.snapshot())
                self._step_total = timing.add(self._step_total, self._last_step)
        if nonfinite is not None and int(nonfinite) > 0:
            warnings.warn(f"{int(nonfinite)} moment value(s) of this step were NaN or infinite (from non-finite "
                          "gradients); int8 state stores them as 0 and keeps them out of their block's scale, so "
                          "the rest of each block is intact (docs/optim.md, \"Smaller state\")", SwapioWarning,
                          stacklevel=4)
        if not self._warned_edit and any(w.adopted for w in works):
            self._warned_edit = True  # once per optimizer (ids are reused, so not swapio's process-wide warn_once)
            warnings.warn(f"a parameter was changed outside {type(self).__name__} since its last step (e.g. "
                          "model.load_state_dict, an in-place clamp or copy); the changed elements were adopted into "
                          "the fp32 master weights. Changes made through `.data` are not seen.", SwapioWarning,
                          stacklevel=4)

    def _threads(self):
        """The kernel's threads: cpu_threads, else every core this process may run on (its affinity mask), one
        left to the thread driving the GPU while updates run during backward."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if self._gpu_in_backward is not None and cores > 2:
            cores -= 1
        return cores

    def _works(self, params, grad_of, data_of=None):
        """(a Work for each wanted parameter that has a gradient, in param-group order; the int8 non-finite
        counter or None). Checks every gradient before anything is stepped."""
        if params is None:  # step(); the updates driven from backward hand each parameter over once
            self._check_listed_once()
        rule, works, index = self._rule, [], -1
        wanted = None if params is None else {id(p) for p in params}
        nonfinite = torch.zeros((), dtype=torch.int64) if rule.format.counts_nonfinite else None
        for i, group in enumerate(self.param_groups):
            try:
                hyper = rule.hyper(group)
            except (TypeError, ValueError) as exc:  # before anything is stepped
                raise type(exc)(f"param group {i}: {exc} (a group's values are checked at each step: this one was "
                                "set by an lr scheduler or an edit of optimizer.param_groups)") from None
            given = [] if wanted is None else [p for p in group["params"] if id(p) in wanted]
            if given:  # an update before step(): what it used, and the p.grad it stepped (_check_hyper_unchanged)
                self._hyper_used.setdefault(i, []).append(
                    (rule.options(group), [(p, weakref.ref(p.grad)) for p in given if p.grad is not None]))
            for p in group["params"]:
                index += 1  # the parameter's index in state_dict(): its seed of bf16 rounding
                if wanted is not None and id(p) not in wanted:
                    continue
                g = grad_of(p)
                if g is None:
                    continue
                if params is not None:  # (step() checked every gradient first: _check_frozen_grads)
                    self._check_steppable(p, index, offloaded=data_of is not None)
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, please "
                                       "consider torch.optim.SparseAdam instead")
                if g.dtype not in PARAM_DTYPES:
                    raise RuntimeError(f"gradient dtype {g.dtype} is not supported (float32, bfloat16, float16)")
                data = data_of(p) if data_of is not None else None
                gs, t = shard(g), data if data is not None else shard(p)
                if gs.shape != t.shape or gs.device != t.device:
                    raise RuntimeError(f"gradient of shape {tuple(gs.shape)} on {gs.device} does not match its "
                                       f"parameter of shape {tuple(t.shape)} on {t.device}")
                st = self.state.get(p)
                new = not st
                self._check_entry(p, index)
                if not new:  # p.data replaced by another size: stepping would read and write state it does not own
                    self._check_fits(p, index, t)
                # a count set by hand may be a number (older torch kept ints): read as loading reads it
                step = 1 if new else int(validate.step_count(
                    st["step"], f"optimizer.state[p]['step'] of parameter {index}").item()) + 1
                works.append(Work(p, g, step, rule.fields(p, group), rule.update, hyper, new,
                                  edited=not new and data is None and self._edited_outside(p), seed=index,
                                  nonfinite=nonfinite, data=data))
        return works, nonfinite

    def _commit(self, works):
        """Advances the step count of every parameter the backend fully stepped (w.done), with the state it
        created for a first step; the others keep their count and state, untouched."""
        for w in works:
            if (w.done or w.started) and not w.external:
                # the kernel wrote the parameter through its pointer: tell autograd, as torch's in-place step does,
                # so that a backward through a graph that saved the old values raises instead of using the new
                torch.autograd.graph.increment_version([w.t] if w.p is w.t else [w.t, w.p])  # (a DTensor, its shard)
            if not w.done:
                if w.started:
                    self._torn.add(w.p)
                continue
            st = self.state[w.p]
            if torch.is_tensor(st.get("step")):
                st["step"].fill_(float(w.step))
            else:
                st["step"] = torch.tensor(float(w.step), dtype=FP32)
            st.update(w.created or {})
            self._backend.note_entry(w.p, st)
            if w.master and not w.external:
                self._written[w.p] = (w.t._version, w.t.data_ptr())

    def _edited_outside(self, p):
        """Whether p was written by someone else since this optimizer last wrote it: its version counter (bumped by
        every in-place op on it or its views, but not through `.data`) or its storage changed. O(1) a parameter.
        Only parameters with a separate fp32 master can go stale; a contiguous fp32 CPU parameter is its own."""
        seen, t = self._written.get(p), shard(p)
        return seen is not None and seen != (t._version, t.data_ptr())

    # ---- state transfer: what state_transfer, state_dict_hooks and checkpoint use ----------------------------
    @property
    def state_format(self):
        """How the state arrays are stored (swapio.optim.state_format.StateFormat)."""
        return self._rule.format

    @property
    def state_keys(self):
        """Every state field name this optimizer's rule may keep (what load_state_dict() reads)."""
        return self._rule.STATE_KEYS

    def param_fields(self):
        """(p, the state fields the rule keeps for p) for every parameter, in param-group order."""
        for group in self.param_groups:
            for p in group["params"]:
                yield p, self._rule.fields(p, group)

    def _placed(self, params_fields, stepped=()):
        """The (p, fields) the backend places: parameters that may be stepped (trainable, holding state, or in
        `stepped`: a frozen one given a gradient by hand). A frozen one is not placed: in nvme mode it took room in
        the swap file (12 bytes an element for an int8 base weight) and, sharing a chunk with a trainable
        neighbour, was read and written at every step (a LoRA model's base weights: 65 times the I/O)."""
        return [(p, f) for p, f in params_fields if p.requires_grad or self.state.get(p) or p in stepped]

    def kept_fields(self, p, group):
        """The state fields kept for p in `group` (missing group keys from the defaults), in storage order."""
        return self._rule.fields(p, {**self.defaults, **group})

    def check_group(self, group):
        """ValueError unless a loaded `group` suits this optimizer and its state: it holds every hyperparameter
        (only flags that older torch versions lacked are filled in, as torch fills them; a group without its lr
        is damaged, not old, and the constructor's value would replace it silently), and they pass the rule's
        checks."""
        missing = [k for k in self._group_keys if k not in group and k not in self._historical_defaults]
        if missing:
            raise ValueError(f"a loaded param group lacks {missing}, which every state dict of "
                             f"{type(self).__name__} (or of its torch.optim counterpart) holds")
        self._rule.hyper({**self.defaults, **group})

    def exported_fields(self):
        """{p: the fields state_dict() (decoded to fp32) and save() (as stored) carry for p} for every parameter."""
        return {p: self._rule.exported(p, g) for g in self.param_groups for p in g["params"]}

    def read_state(self, params, sink):
        """sink(p, first, end, {field: stored view}) for every piece of each of params (which have state)."""
        self._backend.dump(params, sink)

    def live_state_tensors(self, params):
        """{p: {field: live tensor}} of the exported fields where the backend holds them as exported, else None."""
        return self._backend.live_tensors(params, self.exported_fields().__getitem__)

    def install_state(self, groups, state, entries, source, placement, check):
        """Makes `groups` and `state` ({p: {"step"}} plus entries not keyed by parameters) live, all or nothing:
        the backend stores entries {p: fields} in new storage filled by source (see state_transfer), places
        `placement` [(p, fields)], runs check(), and only then swaps the new state in."""
        for index, (p, _) in enumerate(self.param_fields()):
            problem = _unsupported(shard(p), self.is_offloaded(p)) if p in entries else None
            if problem is not None:  # state it could never step, which save() would write and load() refuse
                raise ValueError(f"the loaded state holds state for parameter {index}, which this "
                                 f"{type(self).__name__} took frozen and cannot step: it has {problem}. Load a "
                                 "state without an entry for it (torch's optimizers keep one for a parameter they "
                                 "stepped before it was frozen), or give the optimizer parameters it can step")

        def commit():
            self._installs += 1  # (load_state_dict: from here the backend holds the new state)
            self._answer_in_backward_updates()
            self.__setstate__({"state": state, "param_groups": groups})
            for p, _ in self.param_fields():  # (a parameter the loaded state leaves out holds none now)
                self._backend.note_entry(p, self.state.get(p))
            self._torn = set()
            self._offloaded.rewrite_from_master(self.read_state)  # the offload storage holds the weights the state implies

        self._backend.fill(entries, source, self._placed(placement, entries), state, check, commit)

    def io_handles(self):
        """(read handle, write handle, owned) for checkpoints: the swap handles in nvme mode, new ones in cpu mode
        (owned: the caller closes them; state_transfer.io_handles does)."""
        return self._backend.io_handles()

    # ---- state dicts and checkpoints ---------------------------------------------------------------------------
    def state_dict(self):
        """torch's format: {"state": {i: {"step", <the rule's moments>[, "master"]}}, "param_groups": [...]};
        tensors fp32 on the CPU, shaped like the parameter. "master" (the fp32 master weights) appears only for
        bf16/fp16 parameters; with int8 state the moments' block scales ("<moment>_scale", flat) come too, so that
        load_state_dict() restores them exactly. In cpu mode the tensors are the live state (as with torch); in
        nvme mode they are read from the swap file into new tensors, so the whole state is materialised in RAM:
        for states larger than RAM use save()/load(). torch's Optimizer.state_dict() builds it (its hooks
        included); a post-hook of ours fills in the state from the backend first."""
        self._settle()
        with self._state_lock:
            self._check_whole()
            self._check_fields()
            return super().state_dict()

    def load_state_dict(self, state_dict):
        """Loads torch's format (from this optimizer or its torch.optim counterpart), keeping the state in fp32 even
        for bf16/fp16 parameters. Without "master", the master weights are taken from the parameters. torch's
        Optimizer.load_state_dict() does the work (its hooks included); see swapio.optim.state_dict_hooks.
        A reference ({REFERENCE_KEY: directory}: what the Trainer integration leaves in optimizer.pt instead of
        the state) loads that streaming checkpoint with load()."""
        self._check_open()
        if not isinstance(state_dict, dict):  # (None: torch's AttributeError on .copy())
            raise TypeError(f"load_state_dict takes a state dict (a dict with 'state' and 'param_groups'), got "
                            f"{type(state_dict).__name__}")
        self._backend.check_process()
        self._settle()
        if reference.target(state_dict) is not None:
            path = reference.located(state_dict)
            reference.check(state_dict, path, os.path.join(path, checkpoint.FILE),
                            "opt.load(<checkpoint>/swapio-optim)")
            return self.load(path)
        with self._state_lock:
            self._check_open()
            live_state, live_groups, installs = dict(self.state), self.param_groups, self._installs
            try:
                super().load_state_dict(state_dict)
            except BaseException:
                # torch installs the new groups before our post-hook installs the state; the backend leaves its
                # storage as it was on failure, so putting the live groups and state back restores the optimizer.
                # Once the state is installed (a user's post-hook raised after ours, a Ctrl-C deferred to the end
                # of the install), the backend holds the new arrays: the new counts and groups stay with them, as
                # torch keeps the loaded state when a post-hook raises.
                if self._installs == installs:
                    self.state.clear()
                    self.state.update(live_state)
                    self.param_groups = live_groups
                raise
            finally:
                state_dict_hooks.discard_taken(self)

    def save(self, path, *, progress=None):
        """Writes the optimizer (param groups and all state) to the directory `path` as one safetensors file,
        swapio-optim.safetensors, streaming one chunk at a time, durably and atomically: the file is fsynced and
        renamed into place, so a crash leaves the previous checkpoint (or none) readable. See
        swapio.optim.checkpoint.
        progress: a bar of the bytes written, on stderr (None: only when stderr is a terminal or
        SWAPIO_PROGRESS=1; True/False: always/never; needs tqdm)."""
        progress = check_progress(progress)
        self._settle()
        self._offloaded.flush()  # updates run by backward (in_backward) belong to the state saved
        with self._state_lock:
            self._check_whole()
            self._check_fields()
            checkpoint.save(self, path, progress)

    def load(self, path, *, progress=None):
        """Loads a checkpoint written by save() (from either offload mode, or an older swapio's format version 3),
        streaming one chunk at a time.
        progress: a bar of the bytes read, as for save()."""
        progress = check_progress(progress)
        self._check_open()
        self._backend.check_process()
        self._settle()
        with self._state_lock:
            self._check_open()
            checkpoint.load(self, path, progress)

    def memory_report(self):
        """Where the state lives and what it costs: {"offload", "state_dtype", "params" (elements with state),
        "state_bytes" (RAM in cpu mode; the swap file in nvme mode), "bytes_per_param" (state_bytes / params),
        "io_bytes_per_step" (nvme: read + written per full step), "grad_bytes" (offloaded weights' gradient sums),
        "pinned_bytes" (every pinned buffer behind this optimizer now), "pinned_budget" (the most they hold),
        "pinned_parts" ({part: {"bytes", "budget"}}: "state" (the nvme pipeline's slots, or cpu mode's GPU
        staging), for GPU parameters in cpu mode "gpu_grads" and "gpu_masters" and, for weights of offloaded models, "weight_ring", "weight_spare", "weight_pool", "grads",
        "grad_staging", "weight_hosts"; docs/offload.md, "Host memory")}."""
        self._check_open()
        self._settle()
        stateful = [p for p, st in self.state.items() if isinstance(p, torch.Tensor) and st]
        params = sum(shard(p).numel() for p in stateful)
        report = {"offload": self.offload, "state_dtype": self._rule.format.name, "params": params}
        report.update(self._backend.memory())
        report["grad_bytes"] = self._offloaded.grad_bytes()  # offloaded weights' gradient sums (RAM, or file)
        # the state's slots (cpu mode: staging of a fixed size); slots sized for parameters placed before and
        # forgotten since stay until they are reallocated, hence the max
        state = report.pop("pinned_budget", report["pinned_bytes"])
        parts = {"state": {"bytes": report["pinned_bytes"], "budget": max(state, report["pinned_bytes"])}}
        parts.update(report.pop("pinned_parts", {}))  # cpu mode, GPU parameters: gradient copies, pinned masters
        parts.update(self._offloaded.pinned())
        report["pinned_bytes"] = sum(part["bytes"] for part in parts.values())
        report["pinned_budget"] = sum(part["budget"] for part in parts.values())
        report["pinned_parts"] = parts
        report["bytes_per_param"] = report["state_bytes"] / params if params else 0.0
        return report

    def step_report(self, reset=False):
        """Where the steps' time went: {"last": the last step, "total": every step since the optimizer was built
        or last reset}, each None before a step, else a dict of "steps", "wall_s" (the step, seconds), "kernel_s"
        (in the update kernel: compute), "io_wait_s" (waiting for nvme reads and writes, or GPU copies, not yet
        done), "other_s" (the rest: placing, staging, bookkeeping), "bytes_read", "bytes_written" (the swap file;
        0 in cpu mode) and "read_gbps", "write_gbps" (those bytes per second of wall time, in GB/s). Measured with
        perf_counter around work the step does anyway: no synchronisation is added. reset=True starts the
        totals (and "last") afresh after returning them. See docs/optim.md, "Seeing where time goes"."""
        reset = check_bool("reset", reset, "a bool")
        report = {"last": self._last_step, "total": self._step_total}
        if reset:
            self._last_step = self._step_total = None
        return report

    # ---- lifetime ---------------------------------------------------------------------------------------------
    @property
    def swap_path(self):
        """The private directory holding the swap file (nvme mode), else None."""
        return getattr(self._backend, "directory", None)

    def close(self):
        """Releases the swap file, its directory and the I/O handles (nvme mode). Idempotent."""
        # a step, export, save or load running on another thread ends first (the next one raises "closed"); the
        # lock is not held while the parts below wait for their workers, which take it to step
        with self.__dict__.get("_state_lock") or contextlib.nullcontext():
            backend, self._backend = getattr(self, "_backend", None), None
        # each part closed even when one before it raised (a Ctrl-C while a worker is waited for is raised once
        # everything is released); the offloaded params before the backend's directory, which may hold their sums
        parts = (self.__dict__.get("_offloaded"), self.__dict__.get("_gpu_in_backward"),
                 self.__dict__.get("_grad_copies"), backend)
        finish_all(part.close for part in parts if part is not None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
