"""model.half(), .float(), .to(dtype or device), .cpu(), .cuda() of an offloaded model: no-ops, or a clear error.

All of them go through Module._apply(fn). Offloaded weights stay in swapio's files (or host copies) in their dtype
and are computed on the execution device; between forwards the model holds meta placeholders. A conversion that
keeps both the dtype and that device changes nothing about them (accelerate's prepare moves the model to its
device; users call model.to(device) out of habit): the placeholders are left alone and the call goes on for the
model's resident tensors. One that changes either would make the placeholders describe weights that are not
there: torch then raises about meta tensors (suggesting to_empty(), which would throw the weights away) or the
model silently keeps computing in the old dtype. It is refused, before any tensor changed, with what to do instead.
So is model.share_memory() on the CPU (an _apply of share_memory_): the offloaded weights cannot be shared, and
a no-op lost the updates of Hogwild training in another process without a word.
Each module whose subtree holds offloaded tensors gets an instance `_apply` that checks `fn` on an empty tensor of
each offloaded dtype on the execution device, the outermost call for the whole subtree.
"""
import torch

from .units import table_of

_NONE = object()


class GuardedApply:
    """A module's _apply while its subtree holds offloaded tensors (see the module)."""

    __slots__ = ("streamer", "slots", "unit", "inner", "own")

    def __init__(self, streamer, slots, unit, inner, own):
        self.streamer, self.slots, self.unit, self.inner, self.own = streamer, slots, unit, inner, own

    def __call__(self, fn, *args, **kwargs):
        if getattr(fn, "swapio_checked", False):  # an outer module checked it for this subtree already
            return _hiding_offloaded(self.unit, lambda: self.inner(fn, *args, **kwargs))
        device = self.streamer.device
        for dtype in {s.dtype for s in self.slots}:
            probe = torch.empty(0, dtype=dtype, device=device)
            try:
                out = fn(probe)
            except Exception as exc:  # noqa: BLE001 - e.g. no CUDA here: refused with the reason attached
                raise _refusal(self.slots, dtype, device) from exc
            if not isinstance(out, torch.Tensor) or out.dtype != dtype or out.device != probe.device:
                raise _refusal(self.slots, dtype, device)
            if out.device.type == "cpu" and out.is_shared():  # share_memory(): a fresh probe is never shared
                raise _sharing_refusal(self.slots)
        kept = {id(t) for s in self.slots for t in (s.placeholder, s.stand_in) if t is not None}

        def keep_offloaded(t):
            return t if id(t) in kept else fn(t)
        keep_offloaded.swapio_checked = True
        return _hiding_offloaded(self.unit, lambda: self.inner(keep_offloaded, *args, **kwargs))


def _hiding_offloaded(unit, call):
    """call() with the unit's placeholders (and stand-ins) out of its module's tables, put back in their place in
    the tables' order after: torch's _apply then leaves them alone. With
    torch.__future__.set_swap_module_params_on_conversion(True) it swapped each parameter with what fn gave, the
    placeholder itself here, and failed ("Couldn't swap": swapio holds weak references to placeholders)."""
    module = unit.module if unit is not None else None
    hidden = {}
    if module is not None:
        for attr, kind, slot in unit.entries:
            now = table_of(module, kind).get(attr)
            if now is not None and (now is slot.placeholder or now is slot.stand_in):
                hidden[kind, attr] = now
    if not hidden:
        return call()
    orders = {kind: list(table_of(module, kind)) for kind, _ in hidden}
    for kind, attr in hidden:
        del table_of(module, kind)[attr]
    try:
        return call()
    finally:
        for kind, order in orders.items():
            table = table_of(module, kind)
            now = dict(table)
            table.clear()
            for attr in order:
                if (kind, attr) in hidden:
                    table[attr] = hidden[kind, attr]
                elif attr in now:
                    table[attr] = now.pop(attr)
            table.update(now)  # anything added meanwhile


def _refusal(slots, dtype, device):
    name = next(s.name for s in slots if s.dtype == dtype)
    return RuntimeError(
        f"this conversion (.to(), .half(), .float(), .double(), .bfloat16(), .cpu(), .cuda(), .type()) would change "
        f"the dtype or device of weights offloaded by swapio ({name} is {dtype}, computed on {device}), which stay "
        "in its files as they are. Convert before offloading, or remove_offload(model) first (the weights then need "
        "memory), convert, and offload again; or offload a model in the wanted dtype, with execution_device= the "
        "wanted device. A conversion to the same dtype and execution device is allowed (a no-op for them)")


def _sharing_refusal(slots):
    return RuntimeError(
        f"share_memory() of a model offloaded by swapio cannot share its offloaded weights ({slots[0].name}"
        f"{' and the others' if len(slots) > 1 else ''}): they live in swapio's host copies or files, not in the "
        "module's tensors, so another process (Hogwild training with torch.multiprocessing) would change its own "
        "copy and this one would never see it. "
        "Train an offloaded model in one process, or remove_offload(model) first (the weights then need memory) "
        "and share the resident model")


def install(streamer):
    """Guards the _apply of every module whose subtree holds the streamer's offloaded tensors."""
    own, unit_of = {}, {}
    for unit in streamer.units:
        own.setdefault(id(unit.module), []).extend(slot for _, _, slot in unit.entries)
        unit_of[id(unit.module)] = unit
    below = {}

    def slots_under(module):
        if id(module) not in below:
            found = {id(s): s for s in own.get(id(module), ())}
            for child in module.children():
                found.update((id(s), s) for s in slots_under(child))
            below[id(module)] = list(found.values())
        return below[id(module)]

    for module in streamer.model.modules():
        slots = slots_under(module)
        if slots:
            mine = module.__dict__.get("_apply", _NONE)
            module._apply = GuardedApply(streamer, slots, unit_of.get(id(module)), module._apply, mine)
            streamer.guarded.add(module)


def uninstall(streamer):
    """Puts each module's own _apply back (idempotent), also on modules replaced in the model since (a module
    kept elsewhere is resident again after remove_offload, and converts as torch does)."""
    for module in [*streamer.model.modules(), *streamer.guarded]:
        guard = module.__dict__.get("_apply")
        if isinstance(guard, GuardedApply):
            if guard.own is _NONE:
                del module.__dict__["_apply"]
            else:
                module.__dict__["_apply"] = guard.own
