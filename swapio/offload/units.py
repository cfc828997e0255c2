"""Which tensors of a model are offloaded, and the units that bring them in.

A unit is a module that directly owns offloaded tensors (its own parameters, and its buffers with
offload_buffers): its weights arrive just before its forward and leave after it, like accelerate's hooks on
every module with direct parameters. A tensor shared by several modules (tied weights, e.g. GPT-2's lm_head and
wte) is one Slot used by several units: stored once, fetched by each unit that runs it.
Tensors reached from a module named in keep_resident stay resident, and a tied tensor that any resident module
uses stays resident for all of them.
"""
import weakref

import torch

from ..core._fork_lock import ForkAwareLock
from .no_values import NoValues, call, refuse_pickle

# what another thread may have been doing with an offloaded model when a child forked (ForkAwareLock's error)
FORWARD = "a forward, a backward, an optimizer step or remove_offload"


class Placeholder(torch.nn.Parameter):
    """What an offloaded parameter is between forwards (the meta placeholder, or grafting.py's stand-in): a
    Parameter whose `.data` shares its version counter (torch's `.data` gets a fresh one), so that a change in
    place through it (peft's `weight.data -= delta`) counts in `_version` like one on the parameter itself:
    check_placeholders() then says the change was lost. Assigning it other values is refused at once.
    A meta placeholder holds no values, nor does anything computed from it (no_values.py)."""

    carries_no_values = True  # when meta (a stand-in holds values)
    weight_name = "an offloaded weight"

    @property  # type: ignore[override]
    def data(self):
        with torch._C.DisableTorchFunctionSubclass():
            plain = torch.Tensor.detach(self)  # as torch's, but sharing the version counter (unlike torch's)
        return self._values_like(plain)

    @data.setter
    def data(self, value):
        if not self.is_meta and _holds_only_stand_in_values(self, value):
            return  # a stand-in given its own values again (transformers' tie_weights pads a bias by nothing)
        if not (isinstance(value, torch.Tensor) and value.device == self.device and value.shape == self.shape
                and value.dtype == self.dtype and value.data_ptr() == self.data_ptr()):
            converted = isinstance(value, torch.Tensor) and value.dtype != self.dtype
            raise RuntimeError(  # (torch's _apply assigns the placeholder itself: a no-op, allowed)
                "this parameter is offloaded by swapio: between forwards it holds no values, and assigning "
                f"its .data a tensor ({_describe(value)}) would not change the weight. "
                + (f"Its weights stay {self.dtype} in swapio's storage: offload the model in the dtype wanted "
                   "(peft's prepare_model_for_kbit_training casts fp16/bf16 weights to float32 so: offload a float32 "
                   "model, or freeze the weights yourself instead). " if converted else "") + CHANGE_WEIGHTS)
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch.autograd.grad(loss, model.parameters()) and loss.backward(inputs=...) name placeholders, which no
        # graph contains (each forward computes with a fresh leaf): torch gave them no gradient without a word
        # (None with allow_unused=True; backward(inputs=...) accumulated nothing, so step() updated nothing).
        if func is torch.autograd.grad or func is torch.autograd.backward:
            inputs = (kwargs or {}).get("inputs", args[1] if func is torch.autograd.grad and len(args) > 1 else None)
            inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
            found = [t for t in inputs if isinstance(t, Placeholder)]
            if found:
                raise RuntimeError(
                    f"{func.__module__}.{func.__name__} was given {len(found)} weight(s) offloaded by swapio as "
                    f"inputs (the first {tuple(found[0].shape)} {found[0].dtype}): between forwards such a weight is "
                    "a placeholder that no graph contains (each forward computes with a fresh copy), so torch would "
                    "give it no gradient. Call loss.backward() without inputs= and train offloaded weights with a "
                    "swapio optimizer, or keep their modules resident (keep_resident=[...]) to take their "
                    "gradients with torch.autograd.grad")
        if func is torch.Tensor.register_hook and len(args) > 1 and \
                "register_multi_grad_hook" in getattr(args[1], "__qualname__", ""):
            # mode="all" counts how many of its tensors' nodes the running backward executes: a placeholder's is in
            # no graph (each forward computes with a fresh leaf), so the count was 0 and the hook never ran
            raise RuntimeError(
                f"torch.autograd.graph.register_multi_grad_hook(mode='all') was given {args[0].weight_name}, which is "
                "offloaded by swapio: between forwards it is a placeholder that no backward's graph contains (each "
                "forward computes with a fresh copy), so the hook would never run. Register a hook on each weight "
                "(p.register_hook(fn) or p.register_post_accumulate_grad_hook(fn), which run once per backward on "
                "an offloaded weight as on a resident one), use mode='any', or keep those modules resident "
                "(keep_resident=[...])")
        return call(func, args, kwargs)  # as torch.nn.Parameter's, but values from a meta one are refused

    def detach(self):
        """A Placeholder too, sharing the version counter: torch.nn.Parameter(placeholder) (weight_norm,
        parametrize, libraries that rewrap a weight) requires a Parameter subclass's detach() to keep its type."""
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.Tensor._make_subclass(Placeholder, torch.Tensor.detach(self), False)
        out.weight_name = self.weight_name
        return out

    def __reduce_ex__(self, protocol):  # torch.save of a parameter, of dict(model.named_parameters())
        raise RuntimeError(refuse_pickle(self.weight_name))

    def _values_like(self, plain):
        """`.data`: a meta placeholder's is a NoValues tensor (see no_values.py), a stand-in's a plain one."""
        if not plain.is_meta:
            return plain
        out = plain.as_subclass(NoValues)
        out.weight_name = self.weight_name
        return out


CHANGE_WEIGHTS = ("Change the weights before offloading, or remove_offload(model), change them and offload again. "
                  "peft's merge_adapter, unmerge_adapter and merge_and_unload bring an offloaded base layer's "
                  "weights in and write them back; a merged peft model run with its adapters disabled unmerges "
                  "inside its forward, which they cannot: call unmerge_adapter() first")


def _holds_only_stand_in_values(stand_in, value):
    """Whether `value` is like the stand-in and holds only what it holds (grafting.py: NaN, or 0 for integers)."""
    if not (isinstance(value, torch.Tensor) and value.device == stand_in.device and value.shape == stand_in.shape
            and value.dtype == stand_in.dtype):
        return False
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return bool(value.isnan().all())
    return not bool(value.any())


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__


class Slot:
    """One offloaded tensor: its names in the model, metadata, and the meta placeholder standing in for it."""

    __slots__ = ("names", "shape", "dtype", "is_param", "placeholder", "record", "index", "nbytes", "stand_in",
                 "version", "layout")

    def __init__(self, index, name, tensor, is_param):
        self.index, self.names = index, [name]
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.is_param = is_param
        # a meta tensor of the strides remove_offload gives back: a channels_last weight's (what .clone() keeps);
        # the stored bytes and the fetched views are in logical order
        self.layout = (None if tensor.is_contiguous() else
                       torch.empty_like(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                                            device="meta")))
        meta = torch.empty(self.shape, dtype=self.dtype, device="meta")
        # a buffer's (offload_buffers) holds no values either: `total += model.bn.running_var` did nothing
        self.placeholder = (Placeholder(meta, requires_grad=bool(tensor.requires_grad)) if is_param
                            else meta.as_subclass(NoValues))
        self.placeholder.weight_name = name  # for errors (no_values.py)
        self.record = None
        self.stand_in = None  # shown instead of the placeholder while a wrapper is added (grafting.py)
        self.version = self.placeholder._version  # changes in place since are lost: check_placeholders() says so

    @property
    def requires_grad(self):
        """The flag of what model.parameters() yields between forwards (the placeholder, or its stand-in): a model
        frozen after offloading (peft's get_peft_model freezes every base weight) has frozen fetched weights."""
        return bool((self.stand_in if self.stand_in is not None else self.placeholder).requires_grad)

    @property
    def name(self):
        return self.names[0]

    def __repr__(self):
        return f"<Slot {self.name} {self.shape} {self.dtype}>"


class Unit:
    """A module and the offloaded tensors it owns directly: [(attribute, "param" | "buffer", Slot)]."""

    __slots__ = ("index", "name", "_module", "entries", "records", "depth", "fetches", "hooks_entered", "lock",
                 "own_forward", "wrapper", "buffers_in", "lent")

    def __init__(self, index, name, module):
        # held weakly: the fetcher's records reach their units, and streamer.close() runs from a finalizer holding
        # the fetcher, which must not keep a model dropped without remove_offload alive
        self.index, self.name, self._module = index, name, weakref.ref(module)
        self.entries, self.records = [], []
        self.depth = 0             # nesting of this module's forward calls in progress
        self.fetches = []          # the records' fetches while the forward runs
        self.hooks_entered = []    # saved-tensor hooks installed with the weights (SavedWeights.enter)
        # one thread at a time runs the module (its weights are shared attributes); a fork child is refused it if
        # another thread ran the module at the fork
        self.lock = ForkAwareLock("this offloaded model", FORWARD)
        self.own_forward = None    # while offloaded: the module's own instance forward (or streamer.NO_OWN_FORWARD)
        self.wrapper = None        # while offloaded: a weakref to the OffloadedForward installed as its forward
        self.buffers_in = []       # (attr, slot, tensor installed, its bytes then or None) of the offloaded buffers
        self.lent = []             # (slot, weakref) of the parameters installed in host memory reused after the forward

    @property
    def module(self):
        return self._module()

    def __repr__(self):
        return f"<Unit {self.name or '<root>'} ({len(self.entries)} tensors)>"


def _under(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def direct_tensors(module, offload_buffers):
    """(attribute, kind, tensor) for what `module` itself owns and swapio may offload."""
    for attr, p in module._parameters.items():
        if p is not None:
            yield attr, "param", p
    if offload_buffers:
        for attr, b in module._buffers.items():
            if b is not None:
                yield attr, "buffer", b


def collect(model, offload_buffers, keep_resident=()):
    """(units in module order, slots, resident) where resident lists (module, attribute, kind, qualified name)
    of every tensor that stays resident (buffers without offload_buffers, keep_resident modules, ties to them)."""
    keep = list(keep_resident)
    names = dict(model.named_modules(remove_duplicate=False))
    for k in keep:
        if k not in names:
            raise ValueError(f"keep_resident names {k!r}, which is not a submodule of the model")
    modules = list(model.named_modules(remove_duplicate=False))
    resident_ids = set()
    for name, module in modules:
        if _under(name, keep) or (name == "" and "" in keep):
            for _, _, t in direct_tensors(module, True):
                resident_ids.add(id(t))
    units, slots, by_id, resident, unit_of = [], [], {}, [], {}
    for name, module in modules:
        for attr, kind, t in list(direct_tensors(module, True)):
            qualified = f"{name}.{attr}" if name else attr
            offloaded = (kind == "param" or offload_buffers) and id(t) not in resident_ids
            if not offloaded:
                resident.append((module, attr, kind, qualified))
                continue
            slot = by_id.get(id(t))
            if slot is None:
                slot = by_id[id(t)] = Slot(len(slots), qualified, t, kind == "param")
                slots.append(slot)
            elif qualified not in slot.names:
                slot.names.append(qualified)
            unit = unit_of.get(id(module))
            if unit is None:
                unit = unit_of[id(module)] = Unit(len(units), name, module)
                units.append(unit)
            if not any(a == attr for a, _, _ in unit.entries):
                unit.entries.append((attr, kind, slot))
    return units, slots, resident


def trainable_modules(model):
    """Names of the modules that own peft's trainable parameters (adapters, modules_to_save), which stay resident:
    swapio streams frozen weights only. Only for a peft model (one with a `peft_config`): elsewhere a mix of frozen
    and trainable weights is common (frozen sinusoidal position embeddings) and says nothing about training.
    peft's adapters stay resident frozen too (PeftModel.from_pretrained loads them frozen for inference): they are
    the peft model's own weights, which the base model's checkpoint does not hold."""
    if not any(hasattr(m, "peft_config") for m in model.modules()):
        return []
    names = [name for name, module in model.named_modules()
             if any(p is not None and p.requires_grad for p in module._parameters.values())]
    for name, module in model.named_modules():
        for layer in getattr(module, "adapter_layer_names", ()):  # peft's tuner layers and modules_to_save
            full = f"{name}.{layer}" if name else layer
            try:
                model.get_submodule(full)
            except AttributeError:
                continue
            names.append(full)
    return names


def check_placeholders(slots):
    """RuntimeError naming the first slot whose meta placeholder was changed in place since the last check
    (torch.nn.init.normal_(weight), weight.copy_(x), weight.add_(x) under no_grad): a no-op on a meta tensor
    that would otherwise go unnoticed. Raised once: the weight is as it was, and computing goes on with it."""
    for slot in slots:
        if slot.placeholder._version != slot.version:
            slot.version = slot.placeholder._version
            raise lost_change(slot)


def check_entries(units, forward=False):
    """RuntimeError naming the first offloaded attribute assigned another tensor since the last check (accelerate's
    set_module_tensor_to_device, `module.weight = nn.Parameter(x)`) or taken out of its module (weight_norm and
    parametrize move it into a parametrization): a forward would put fetched weights, then the placeholder, in its
    place, dropping the change without a word. Raised once: the placeholder goes back, the weight is as it was;
    except, at a `forward`, for one taken out, whose module no longer reads that attribute: raised at each forward
    (remove_offload puts it back). Stand-ins (grafting.py) are swapio's own."""
    for unit in units:
        with unit.lock:  # another thread's forward of the module has its fetched weights in place: wait for it
            if unit.depth and not forward:
                continue  # this thread runs the module (a save from inside its forward): those are the fetched ones
            _check_entries_of(unit, forward)


def _check_entries_of(unit, forward):
    module = unit.module
    if module is None:
        return  # replaced in the model (`model.head = nn.Linear(...)`) and collected: nothing reads its weights
    for attr, kind, slot in unit.entries:
        now = table_of(module, kind).get(attr)
        if now is slot.placeholder or (now is slot.stand_in and now is not None):
            continue
        if now is not None or not forward:
            set_entry(module, attr, kind, slot.placeholder)
        how = (f"taken out of its module (`del module.{attr}`, torch's weight_norm or parametrize)" if now is None
               else f"replaced between forwards (assigned {_describe(now)}: `module.{attr} = ...`, accelerate's "
               "set_module_tensor_to_device)")
        raise RuntimeError(f"{slot.name} is offloaded by swapio and was {how}: swapio streams its stored weight "
                           "into that attribute, so the change is lost and the weight is as it was. "
                           + CHANGE_WEIGHTS)


def check_unchanged(units):
    """check_entries, then check_placeholders, over these units' weights: before what the model holds is read
    (save_checkpoint, remove_offload) or brought in to be changed (peft's merges)."""
    units = tuple(units)
    check_entries(units)
    check_placeholders(slot for unit in units for _, _, slot in unit.entries)


def lost_change(slot):
    """The RuntimeError of a change in place made to what stands for an offloaded weight between forwards."""
    return RuntimeError(
        f"{slot.name} is offloaded by swapio and was changed in place between forwards (torch.nn.init, copy_, add_, "
        "fill_ or .data on the tensor model.parameters() yields): that tensor holds no values (a meta placeholder), "
        "so the change was lost and the weight is as it was. " + CHANGE_WEIGHTS)


def install_placeholders(units):
    """Points every offloaded attribute at its meta placeholder (frees the model's own copy when unshared)."""
    for unit in units:
        for attr, kind, slot in unit.entries:
            set_entry(unit.module, attr, kind, slot.placeholder)


def table_of(module, kind):
    """The module's own dict that holds an entry of this kind: _parameters for "param", else _buffers."""
    return module._parameters if kind == "param" else module._buffers


def get_entry(module, attr, kind):
    return table_of(module, kind)[attr]


def set_entry(module, attr, kind, value):
    table_of(module, kind)[attr] = value


def refuse_meta_inputs(args, kwargs, device):
    """A RuntimeError for a meta tensor among a forward's inputs. transformers' habit `inputs.to(model.device)`
    makes them: model.device is the first parameter's device, which for an offloaded model is its meta
    placeholder's. On the CPU an embedding of meta indices reads uninitialised memory (silently wrong logits); on
    a GPU moving them fails with "Cannot copy out of meta tensor", which names neither cause."""
    named = (*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items())
    meta = [name for name, x in named if isinstance(x, torch.Tensor) and x.is_meta]
    if meta:
        raise RuntimeError(f"{meta[0]} is on the meta device, which holds no values. A model offloaded by swapio "
                           "keeps meta placeholders as its parameters between forwards, so model.device "
                           "(transformers) and next(model.parameters()).device say 'meta': put inputs on the "
                           f"execution device ({device}) instead, e.g. inputs.to({str(device)!r}). (A weight of "
                           "another offloaded module, passed as an input, is such a placeholder too: keep that "
                           "module resident with keep_resident=[...]. transformers' generate() of some models, "
                           "such as Whisper, builds inputs on model.device itself: keep resident the module that "
                           "owns the model's first parameter, and model.device is the execution device.)")


def move_to(device):
    """The function that moves a forward's tensor inputs to `device` (asynchronously) and passes anything else."""
    return lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
