"""Modules wrapped after offloading (peft's get_peft_model) get their new parameters on the execution device.

Between forwards an offloaded weight is a meta placeholder, and code that wraps a module puts what it creates on
that module's weight's device: peft's LoRA layers move their adapters to `base_layer.weight.device`, which made
adapters added after offloading meta tensors (backward then failed: "expected device meta"). So when an
offloaded module is registered under a module outside the offloaded model (peft's LoraModel takes the model, each
LoRA layer takes its base layer as `base_layer`), its offloaded weights show stand-ins until the model's next
forward: tensors of the right shape and dtype on the execution device that take no memory (one element expanded,
NaN for floating types, so code that computes with them gives NaN rather than plausible values), like the
placeholders themselves. The model's next forward puts the placeholders back, first carrying over any
`requires_grad` change made to a stand-in (peft freezes every base weight). A torch global module registration
hook does the watching; it only looks the registered module up in swapio's registry of offloaded modules.
ModuleList and ModuleDict parents are left out: they only hold modules, often for a moment (transformers slices
its layers, `self.layers[:n]`, in every forward). A module registered as `base_layer` (peft's tuner layers) also
gets onload.py's hook, through which peft's merges write the stored weights.
"""
import weakref

import torch

from . import dora, graph_capture, onload
from .compiled import is_compile_wrapper, runs_eagerly
from .no_copy import refuse_copy
from .streamer import WeightStreamer
from .registry import offloaded
from .units import Placeholder, lost_change, set_entry

_hook = None
_with_stand_ins = weakref.WeakSet()  # streamers that have stand-ins installed: restore() skips the others at once
_wrappers = weakref.WeakKeyDictionary()  # streamer -> the peft tuner layers that wrapped its modules since restore()


def _stand_in(slot, device):
    fill = float("nan") if slot.dtype.is_floating_point or slot.dtype.is_complex else 0
    t = torch.full((), fill, dtype=slot.dtype, device=device).expand(slot.shape)
    return Placeholder(t, requires_grad=slot.requires_grad) if slot.is_param else t


def _table(module, kind):
    return module._parameters if kind == "param" else module._buffers


def _on_register(parent, name, child):
    if not isinstance(child, torch.nn.Module):
        return None
    streamer = offloaded.get(child)
    if not isinstance(streamer, WeightStreamer) or offloaded.get(parent) is streamer or is_compile_wrapper(parent):
        return None
    if type(parent) in (torch.nn.ModuleList, torch.nn.ModuleDict):  # they only hold modules, often for a moment
        return None  # (transformers' `self.layers[:n]` in forward): nothing to create, no stand-ins
    inside = {id(m) for m in child.modules()}
    for unit in streamer.units:
        if id(unit.module) not in inside or unit.depth:
            continue
        for attr, kind, slot in unit.entries:
            if _table(unit.module, kind).get(attr) is slot.placeholder:
                if slot.stand_in is None:
                    slot.stand_in = _stand_in(slot, streamer.device)
                    streamer.training.register_stand_in(slot)
                set_entry(unit.module, attr, kind, slot.stand_in)
                _with_stand_ins.add(streamer)
    if name == "base_layer":  # peft's tuner layer: its merges bring the weights in through accelerate's protocol
        onload.attach(streamer, child, restore)
        _wrappers.setdefault(streamer, weakref.WeakSet()).add(parent)  # (DoRA, created on the stand-ins: restore)
    return None


def restore(streamer):
    """Placeholders back in place of stand-ins, with the stand-ins' requires_grad; then the RuntimeError of a peft
    DoRA adapter created on the stand-ins (dora.py), or of a stand-in changed in place meanwhile (fill_, zero_:
    what its one expanded element lets through), if any."""
    if streamer not in _with_stand_ins:
        return
    _with_stand_ins.discard(streamer)
    wrappers = list(_wrappers.pop(streamer, ()))
    for unit in streamer.units:
        if unit.depth or unit.module is None:
            continue
        for attr, kind, slot in unit.entries:
            stand_in = slot.stand_in
            if stand_in is None:
                continue
            if _table(unit.module, kind).get(attr) is stand_in:
                set_entry(unit.module, attr, kind, slot.placeholder)
    changed = None
    for slot in streamer.slots:
        if slot.stand_in is not None:
            if slot.is_param:
                slot.placeholder.requires_grad_(slot.stand_in.requires_grad)
            if slot.stand_in._version and changed is None:
                changed = slot
            slot.stand_in = None
    with_dora = next((w for w in wrappers if dora.uses_dora(w)), None)
    if with_dora is not None:  # (first: the adapter itself is unusable)
        raise dora.created_on_stand_ins(with_dora)
    if changed is not None:
        raise lost_change(changed)


def watch(streamer):
    """Installs the global hook (once) and the model's forward pre-hook that restores placeholders."""
    global _hook
    if _hook is None:
        _hook = torch.nn.modules.module.register_module_module_registration_hook(_on_register)
    onload.attach_base_layers(streamer, restore)
    streamer.handles.append(streamer.model.register_forward_pre_hook(_Restore(streamer), prepend=True))


@runs_eagerly
class _Restore:
    """The model's forward pre-hook that puts placeholders back; refuses copies, as the streamer's wrappers do."""

    __slots__ = ("streamer",)

    def __init__(self, streamer):
        self.streamer = streamer

    def __call__(self, module, args):
        graph_capture.refuse_capture()  # (before restore: export's fake tensors are not the user's replacements)
        restore(self.streamer)

    def __reduce_ex__(self, protocol):
        refuse_copy()

    __deepcopy__ = __copy__ = lambda self, *memo: self.__reduce_ex__(None)
