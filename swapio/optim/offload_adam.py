"""OffloadAdam / OffloadAdamW: torch.optim.Adam / AdamW with the fp32 master weights and the moments in CPU RAM
(offload="cpu") or in swap files on NVMe (offload="nvme"), stepping on the CPU through the functional core
(swapio.optim.functional: the update rule; the state backends cpu_state / nvme_state walk the state)."""
import inspect
import json
import os
import warnings
from collections import defaultdict
from copy import deepcopy
from itertools import chain

import torch
from torch.optim import Optimizer

from .._errors import SwapioWarning, check_int
from ..handle import AioHandle
from . import checkpoint, state_dict_hooks
from ._common import FP32, MASTER, PARAM_DTYPES, Work, shard
from .cpu_state import CpuState
from .ctrl_c import DeferredSigint
from .functional import AdamRule
from .nvme_state import NvmeState

_IO_KEYS = tuple(k for k in inspect.signature(AioHandle.__init__).parameters if k != "self")
_HISTORICAL_DEFAULTS = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False}  # torch.optim.Adam's
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")


def _io_settings(io_config, io_kwargs):
    unknown = sorted(set(io_kwargs) - set(_IO_KEYS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}: OffloadAdam takes Adam's hyperparameters, "
                        f"offload options and AioHandle settings {list(_IO_KEYS)} (it always steps with swapio's "
                        "fused CPU kernel, so foreach/fused/capturable/differentiable do not apply)")
    settings = {}
    if io_config is not None:
        config = io_config
        if not isinstance(config, dict):
            with open(os.fspath(config)) as f:
                config = json.load(f)
        settings.update(config.get("handle", config))
        AioHandle.from_config(dict(settings)).close()  # validates the keys and values now
    settings.update(io_kwargs)
    return settings


def _check_betas_kind(betas):
    """torch's rule: betas are both numbers or both tensors."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        return
    if isinstance(beta1, torch.Tensor) != isinstance(beta2, torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")


class OffloadAdam(Optimizer):
    """Adam (L2 weight decay, like torch.optim.Adam) with optimizer state off the GPU.

    Hyperparameters (per param group, validated like torch): lr, betas, eps, weight_decay, amsgrad, maximize,
    decoupled_weight_decay (True gives AdamW). Parameters may be on the CPU or a CUDA device, fp32, bf16 or
    fp16, or DTensors (FSDP2's fully_shard), whose local shards are stepped and keep the state. The optimizer keeps an fp32 master copy of every parameter that is not itself a contiguous fp32 CPU
    tensor, steps it on the CPU, and writes the result back into the parameter (for a GPU through pinned
    memory with non_blocking copies, synchronised before step() returns). A parameter changed outside the
    optimizer since its last step (in-place writes, not through `.data`) has its changed elements adopted into
    the master, with one warning (docs/optim.md, "Master weights").

    offload: "cpu" keeps master and moments in RAM; "nvme" keeps them in a swap file in a private directory
        (mkdtemp, mode 0700) under swap_dir, removed by close() or when the optimizer is garbage collected.
    buffer_bytes, buffer_count: pinned host memory for the nvme pipeline: buffer_count (>= 3) slots of
        buffer_bytes / buffer_count bytes in rotation (read of chunk i+1 || compute of chunk i || write of
        chunk i-1). Host memory used for the state stays within buffer_bytes whatever the model size. In cpu
        mode the same budget sizes the staging buffers for GPU parameters.
    cpu_threads: threads of the Adam kernel (None: torch.get_num_threads()).
    io_config: a JSON file (or dict) written by `swapio tune`; **io_kwargs: AioHandle settings (block_size,
        queue_depth, threads, engine, direct) overriding it. Used for the swap file and for save()/load().
    state_dtype: how the moments are stored: "fp32" (default), "bf16" (stochastic rounding) or "int8"
        (block-wise dynamic quantisation, 256 elements a block); the master copy stays fp32. Not with amsgrad.
        See swapio.optim.state_format and docs/optim.md ("Smaller state").
    """

    _decoupled = False
    _rule_type = AdamRule  # the update and the state it keeps (swapio.optim.functional)
    _group_keys = _GROUP_KEYS  # what every param group holds (missing keys come from the defaults)
    _historical_defaults = _HISTORICAL_DEFAULTS

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, decoupled_weight_decay=False, offload="cpu", swap_dir=None,
                 buffer_bytes=256 << 20, buffer_count=4, cpu_threads=None, io_config=None, state_dtype="fp32",
                 **io_kwargs):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "decoupled_weight_decay": bool(decoupled_weight_decay)}
        self._start(params, defaults, offload, swap_dir, buffer_bytes, buffer_count, cpu_threads, io_config,
                    io_kwargs, state_dtype)

    def _start(self, params, defaults, offload, swap_dir, buffer_bytes, buffer_count, cpu_threads, io_config,
               io_kwargs, state_dtype):
        """What every offloaded optimizer's constructor does once its rule's defaults are packed: validate them
        and the offload options, then build the state backend."""
        self._rule = self._rule_type(state_dtype)  # ValueError for an unknown state_dtype
        _check_betas_kind(defaults["betas"])
        hyper = self._rule.hyper(defaults)  # validates, as torch's constructors do
        defaults["betas"] = (hyper["beta1"], hyper["beta2"])
        if offload not in ("cpu", "nvme"):
            raise ValueError(f'offload must be "cpu" or "nvme", got {offload!r}')
        buffer_count = check_int("buffer_count", buffer_count, 3)
        buffer_bytes = check_int("buffer_bytes", buffer_bytes, 1)
        if buffer_bytes // buffer_count < 64 << 10:
            raise ValueError(f"buffer_bytes / buffer_count must be at least 64 KiB, got {buffer_bytes} / "
                             f"{buffer_count}")
        if cpu_threads is not None:
            cpu_threads = check_int("cpu_threads", cpu_threads, 1)
        self._io = _io_settings(io_config, io_kwargs)
        self.offload, self.buffer_bytes, self.buffer_count = offload, buffer_bytes, buffer_count
        self.cpu_threads = cpu_threads
        self._backend = None
        self._written = {}  # p -> (version, data_ptr) after this optimizer's last write of p
        self._warned_edit = False
        self._torn = set()  # parameters an error inside step() left half-stepped (see _check_whole)
        super().__init__(params, defaults)
        state_dict_hooks.register(self)
        if offload == "nvme":
            self._backend = NvmeState(self, swap_dir, buffer_bytes, buffer_count, self._io)
        else:
            self._backend = CpuState(self, buffer_bytes // buffer_count, self._io)

    # ---- torch.optim.Optimizer protocol ------------------------------------------------------------------------
    def __setstate__(self, state):
        """Also what load_state_dict ends with: a group from an older torch that lacks a key gets torch's historical
        default for it (as torch.optim.Adam/AdamW fill it), not this optimizer's constructor argument."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._historical_defaults.items():
                group.setdefault(key, value)
            self._fill_group(group)

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
        for p in group["params"]:
            problem = None
            p = shard(p)  # a DTensor (FSDP2) is stepped through its local shard
            if p.dtype not in PARAM_DTYPES:
                problem = f"dtype {p.dtype} (supported: float32, bfloat16, float16)"
            elif p.device.type not in ("cpu", "cuda"):
                problem = f"device {p.device} (supported: cpu, cuda)"
            elif p.layout != torch.strided:
                problem = f"layout {p.layout} (only dense parameters)"
            if problem is not None:
                self.param_groups.pop()
                raise ValueError(f"{type(self).__name__} cannot optimize a parameter with {problem}")
        try:
            self._fill_group(group)
        except BaseException:
            self.param_groups.pop()
            raise

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

    def param_fields(self):
        """(p, the state fields the rule keeps for p) for every parameter, in param-group order."""
        for group in self.param_groups:
            for p in group["params"]:
                yield p, self._rule.fields(p, group)

    def _check_open(self):
        if self._backend is None:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def _check_whole(self):
        """RuntimeError while an error inside step() has left a parameter half-stepped (one spanning several nvme
        chunks, stopped between them): its state is neither the old nor the new, so stepping, exporting or
        saving it would spread the damage. load() or load_state_dict() of a checkpoint makes it whole again."""
        self._check_open()
        if self._torn:
            index = {id(p): i for i, (p, _) in enumerate(self.param_fields())}
            torn = sorted(index.get(id(p), -1) for p in self._torn)
            raise RuntimeError(f"parameter(s) {torn} of this {type(self).__name__} were left half-stepped by an "
                               "error inside step() (their state is neither the old nor the new one): load a "
                               "checkpoint with load() or load_state_dict() before stepping, exporting or saving")

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step for every parameter with a gradient; returns closure's loss when given."""
        self._check_whole()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rule, works, index = self._rule, [], -1
        nonfinite = torch.zeros((), dtype=torch.int64) if rule.format.name == "int8" else None
        for group in self.param_groups:
            hyper = rule.hyper(group)
            for p in group["params"]:
                index += 1  # the parameter's index in state_dict(): its seed of bf16 rounding
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients, please "
                                       "consider torch.optim.SparseAdam instead")
                if g.dtype not in PARAM_DTYPES:
                    raise RuntimeError(f"gradient dtype {g.dtype} is not supported (float32, bfloat16, float16)")
                g, t = shard(g), shard(p)
                if g.shape != t.shape or g.device != t.device:
                    raise RuntimeError(f"gradient of shape {tuple(g.shape)} on {g.device} does not match its "
                                       f"parameter of shape {tuple(t.shape)} on {t.device}")
                st = self.state.get(p)
                new = not st
                step = 1 if new else int(st["step"].item()) + 1
                works.append(Work(p, step, rule.fields(p, group), rule.update, hyper, new,
                                  edited=not new and self._edited_outside(p), seed=index, nonfinite=nonfinite))
        if not works:
            return loss
        with DeferredSigint() as ctrl_c:
            try:
                self._backend.step(works, self.cpu_threads, ctrl_c)
            finally:  # also when interrupted: the parameters fully stepped get their new count
                self._commit(works)
        if nonfinite is not None and int(nonfinite) > 0:
            warnings.warn(f"{int(nonfinite)} moment value(s) of this step were NaN or infinite (from non-finite "
                          "gradients); int8 state stores them as 0 and keeps them out of their block's scale, so "
                          "the rest of each block is intact (docs/optim.md, \"Smaller state\")", SwapioWarning,
                          stacklevel=2)
        if not self._warned_edit and any(w.adopted for w in works):
            self._warned_edit = True  # once per optimizer (ids are reused, so not swapio's process-wide warn_once)
            warnings.warn(f"a parameter was changed outside {type(self).__name__} since its last step (e.g. "
                          "model.load_state_dict, an in-place clamp or copy); the changed elements were adopted into "
                          "the fp32 master weights. Changes made through `.data` are not seen.", SwapioWarning,
                          stacklevel=2)
        return loss

    def _commit(self, works):
        """Advances the step count of every parameter the backend fully stepped (w.done), with the state it
        created for a first step; the others keep their count and state, untouched."""
        for w in works:
            if not w.done:
                if w.started:
                    self._torn.add(w.p)
                continue
            st = self.state[w.p]
            if "step" in st:
                st["step"].fill_(float(w.step))
            else:
                st["step"] = torch.tensor(float(w.step), dtype=FP32)
            st.update(w.created or {})
            if w.master:
                self._written[w.p] = (w.t._version, w.t.data_ptr())

    def _edited_outside(self, p):
        """Whether p was written by someone else since this optimizer last wrote it: its version counter (bumped by
        every in-place op on it or its views, but not through `.data`) or its storage changed. O(1) a parameter.
        Only parameters with a separate fp32 master can go stale; a contiguous fp32 CPU parameter is its own."""
        seen, t = self._written.get(p), shard(p)
        return seen is not None and seen != (t._version, t.data_ptr())

    def state_dict(self):
        """torch's format: {"state": {i: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"][, "master"]}},
        "param_groups": [...]}; tensors fp32 on the CPU, shaped like the parameter. "master" (the fp32 master
        weights) appears only for bf16/fp16 parameters; with int8 state the moments' block scales
        ("exp_avg_scale", "exp_avg_sq_scale", flat) come too, so that load_state_dict() restores them exactly.
        In cpu mode the tensors are the live state (as with torch); in nvme mode they are read from the swap file
        into new tensors, so the whole state is materialised in RAM: for states larger than RAM use
        save()/load(). torch's Optimizer.state_dict() builds it (its hooks included); a post-hook of ours fills
        in the state from the backend first."""
        self._check_whole()
        return super().state_dict()

    def _pack_groups(self):
        index, packed_groups, start = {}, [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for i, p in enumerate(group["params"], start):
                index.setdefault(id(p), i)
            packed["params"] = [index[id(p)] for p in group["params"]]
            start += len(packed["params"])
            packed_groups.append(packed)
        return packed_groups, index

    def _fields_of(self):
        """A function p -> the fields state_dict() (decoded to fp32) and save() (as stored) carry for p."""
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        return lambda p: self._rule.exported(p, group_of[p])

    def _remap_groups(self, saved_groups):
        """torch's checks: same number of groups and of parameters per group. Returns (id -> parameter,
        new param_groups)."""
        groups = self.param_groups
        saved_groups = deepcopy(saved_groups)
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        new_groups = []
        for g, s in zip(groups, saved_groups):
            s["params"] = g["params"]
            if "param_names" in g and "param_names" not in s:
                s["param_names"] = g["param_names"]
            new_groups.append(s)
        return id_map, new_groups

    def _check_loaded_fields(self, p, kept, have):
        """ValueError unless `have` holds every field in `kept` (the rule's fields for p) but the master, which
        can be taken from the parameter, and int8 scales, which come with their moments."""
        missing = [f for f in kept if f != MASTER and not self._rule.format.is_scale(f) and f not in have]
        if missing:
            raise ValueError(f"the loaded state of a parameter of shape {tuple(shard(p).shape)} lacks {missing}")

    def _install(self, new_groups, steps, fields, source, extra_state=None, check=None):
        """Replaces groups and state, all or nothing. steps: {p: fp32 step tensor}; fields: {p: set of exported
        fields the source has}; source(p, first, end, {field: view}) fills the stored views of elements
        [first, end) of p but the master when the source has none (taken from the parameter here), as in the
        backends' fill(); check(): raises if what was read must not be used (checksums). On any failure the
        optimizer keeps its groups and state as they were."""
        for g in new_groups:
            self._rule.hyper({**self.defaults, **g})  # e.g. amsgrad groups into an int8 optimizer
        kept = {p: self._rule.fields(p, {**self.defaults, **g}) for g in new_groups for p in g["params"]}
        for p, have in fields.items():
            self._check_loaded_fields(p, kept[p], have)
        state = defaultdict(dict)
        for p, step in steps.items():
            state[p]["step"] = step
        for k, v in (extra_state or {}).items():
            state[k] = v

        def commit():
            self.__setstate__({"state": state, "param_groups": new_groups})
            self._torn = set()

        def filled(p, a, b, views):
            if MASTER in views and MASTER not in fields[p]:
                views = dict(views)
                views.pop(MASTER).copy_(shard(p).detach().reshape(-1)[a:b])
            return source(p, a, b, views)

        self._backend.fill({p: kept[p] for p in steps}, filled, list(kept.items()), state,
                           check or (lambda: None), commit)

    def load_state_dict(self, state_dict):
        """Loads torch's format (from OffloadAdam[W] or torch.optim.Adam[W]), keeping the moments in fp32 even
        for bf16/fp16 parameters. Without "master", the master weights are taken from the parameters. torch's
        Optimizer.load_state_dict() does the work (its hooks included); see swapio.optim.state_dict_hooks."""
        self._check_open()
        live = self.state, self.param_groups
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            # torch installs the new groups before our post-hook installs the state; the backend leaves its
            # storage as it was on failure, so putting the live groups and state back restores the optimizer.
            self.__dict__.update(state=live[0], param_groups=live[1])
            raise
        finally:
            state_dict_hooks.discard_taken(self)

    # ---- streaming checkpoints ---------------------------------------------------------------------------------
    def save(self, path):
        """Writes the optimizer (param groups and all state) to the directory `path`, streaming one chunk at a
        time, durably and atomically: data then metadata are fsynced, and the metadata file is renamed into
        place last, so a crash leaves the previous checkpoint (or none) readable. See swapio.optim.checkpoint."""
        self._check_whole()
        checkpoint.save(self, path)

    def load(self, path):
        """Loads a checkpoint written by save() (from either offload mode), streaming one chunk at a time."""
        self._check_open()
        checkpoint.load(self, path)

    def memory_report(self):
        """Where the state lives and what it costs: {"offload", "state_dtype", "params" (elements with state),
        "state_bytes" (RAM in cpu mode; the swap file in nvme mode), "bytes_per_param" (state_bytes / params),
        "pinned_bytes" (the nvme pipeline's buffers), "io_bytes_per_step" (nvme: read + written per full step)}."""
        self._check_open()
        stateful = [p for p, st in self.state.items() if isinstance(p, torch.Tensor) and st]
        params = sum(shard(p).numel() for p in stateful)
        report = {"offload": self.offload, "state_dtype": self._rule.format.name, "params": params}
        report.update(self._backend.memory())
        report["bytes_per_param"] = report["state_bytes"] / params if params else 0.0
        return report

    def _io_handle(self):
        """(read handle, write handle, owned): the swap handles in nvme mode, new ones in cpu mode."""
        return self._backend.io_handles()

    # ---- lifetime ---------------------------------------------------------------------------------------------
    @property
    def swap_path(self):
        """The private directory holding the swap file (nvme mode), else None."""
        return getattr(self._backend, "directory", None)

    def close(self):
        """Releases the swap file, its directory and the I/O handles (nvme mode). Idempotent."""
        backend, self._backend = getattr(self, "_backend", None), None
        if backend is not None:
            backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class OffloadAdamW(OffloadAdam):
    """AdamW (decoupled weight decay, like torch.optim.AdamW) with optimizer state off the GPU. See OffloadAdam."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, offload="cpu", swap_dir=None, buffer_bytes=256 << 20, buffer_count=4,
                 cpu_threads=None, io_config=None, state_dtype="fp32", **io_kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, offload=offload, swap_dir=swap_dir, buffer_bytes=buffer_bytes,
                         buffer_count=buffer_count, cpu_threads=cpu_threads, io_config=io_config,
                         state_dtype=state_dtype, **io_kwargs)
