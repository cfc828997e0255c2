"""model.load_state_dict() of an offloaded model: offloaded weights are refused, resident tensors load as usual.

Between forwards an offloaded attribute holds a meta placeholder: torch would copy a loaded weight into it (a
no-op behind a warning) or, with assign=True, put the loaded tensor in its place until the next forward puts
the fetched weights back. Either way the model would go on computing with its old weights. Each unit's
_load_from_state_dict (what every load_state_dict calls, whichever module it is called on) reports such a key in
torch's own error list, so load_state_dict raises its usual RuntimeError naming it, and leaves the placeholder
alone. Writing loaded values into swapio's host copies or files is not supported.
"""
from .no_copy import refuse_copy

_NONE = object()


class GuardedLoad:
    """A unit module's _load_from_state_dict while it is offloaded (see the module)."""

    __slots__ = ("entries", "inner", "own")

    def __init__(self, entries, inner, own):
        self.entries, self.inner, self.own = entries, inner, own

    def __call__(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        refused = [prefix + attr for attr, _, _ in self.entries if prefix + attr in state_dict]
        if refused:
            for key in refused:
                error_msgs.append(
                    f"{key} is offloaded by swapio, and load_state_dict cannot change offloaded weights (the model "
                    "holds meta placeholders between forwards). Offload the new weights instead: "
                    "cpu_offload(model, state_dict=...), disk_offload(model, checkpoint=...) of a checkpoint "
                    "holding them, or remove_offload(model), load, and offload again. Resident tensors load as usual")
            state_dict = {k: v for k, v in state_dict.items() if k not in refused}
            before = len(missing_keys)
        self.inner(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if refused:  # given, just refused: not missing
            missing_keys[before:] = [k for k in missing_keys[before:] if k not in refused]

    def __reduce_ex__(self, protocol):
        refuse_copy()


def install(streamer):
    wrap_units(streamer, "_load_from_state_dict", lambda unit, inner, own: GuardedLoad(unit.entries, inner, own))


def uninstall(streamer):
    unwrap_units(streamer, "_load_from_state_dict", GuardedLoad)


def wrap_units(streamer, method, make_guard):
    """Gives each unit module an instance attribute `method` = make_guard(unit, the bound method, the module's own
    instance attribute or _NONE), which unwrap_units puts back."""
    for unit in streamer.units:
        module = unit.module
        own = module.__dict__.get(method, _NONE)
        setattr(module, method, make_guard(unit, getattr(module, method), own))


def unwrap_units(streamer, method, guard_type):
    """Puts each unit's own `method` back (idempotent)."""
    for unit in streamer.units:
        module = unit.module
        guard = module.__dict__.get(method) if module is not None else None
        if isinstance(guard, guard_type):
            if guard.own is _NONE:
                del module.__dict__[method]
            else:
                module.__dict__[method] = guard.own
