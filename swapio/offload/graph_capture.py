"""torch.jit.trace, torch.jit.script and torch.export of an offloaded model: refused, saying why and what to do.

An offloaded module's forward puts freshly fetched weights into its attributes and takes them away after. None
of these can hold that: a trace records one call's weights as constants (the whole model resident, read from
memory swapio reuses) and failed on an internal assert of torch's; export puts fake tensors where the
placeholders are, which the forward took for the user's replacement of a weight ("replaced between forwards"),
or failed on the wrapper's missing `__code__`; scripting compiles the module's class, not the wrapper, and failed
on an AttributeError of torch's. torch.compile runs each offloaded module eagerly instead (compiled.py).
"""
import torch

from .no_copy import refuse_copy


def _refusal(what, verb):
    return RuntimeError(
        f"{what} of a model offloaded by swapio is not supported: its offloaded modules' forwards swap the weights "
        f"in and out, which {what} cannot capture (it would record one call's weights as constants). Use "
        "torch.compile (it runs offloaded modules eagerly), or remove_offload(model) first (the weights then need "
        f"memory) and {verb} the resident model")


def refuse_capture():
    """Raises if a jit trace or an export is recording the running forward (its weights would become
    constants); called first by every offloaded forward and by the model's placeholder-restoring pre-hook."""
    if torch.jit.is_tracing():
        raise _refusal("torch.jit.trace", "trace")
    if torch.compiler.is_exporting():
        raise _refusal("torch.export", "export")


class RefuseScripting:
    """`__prepare_scriptable__` of each module holding offloaded tensors (itself or below): torch.jit.script calls
    it on the module and on every submodule before compiling anything."""

    __slots__ = ()

    def __call__(self):
        raise _refusal("torch.jit.script", "script")

    def __reduce_ex__(self, protocol):
        refuse_copy()

    __deepcopy__ = __copy__ = lambda self, *memo: self.__reduce_ex__(None)


_ATTR = "__prepare_scriptable__"


def install(streamer):
    """Puts the refusal on every module whose subtree holds the streamer's units (an instance attribute: no
    torch module defines one of its own)."""
    units = {id(unit.module) for unit in streamer.units}
    holding = {}

    def holds(module):
        if id(module) not in holding:
            holding[id(module)] = id(module) in units or any([holds(child) for child in module.children()])
        return holding[id(module)]

    for module in streamer.model.modules():
        if holds(module) and _ATTR not in module.__dict__:
            module.__dict__[_ATTR] = RefuseScripting()
            streamer.guarded.add(module)


def uninstall(streamer):
    """Takes the refusals off (idempotent), also from modules replaced in the model since (still held elsewhere)."""
    for module in [*streamer.model.modules(), *streamer.guarded]:
        if isinstance(module.__dict__.get(_ATTR), RefuseScripting):
            del module.__dict__[_ATTR]
