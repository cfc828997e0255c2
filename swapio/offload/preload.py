"""preload_module_classes (accelerate's argument): modules of these classes get all their submodules' weights at
the start of their own forward, for modules that use a submodule's weight directly rather than calling it.

Each such module's forward is wrapped like an offloaded module's (streamer.OffloadedForward): the wrapper takes the
lock of every unit under it and enters them (fetching their records and installing their weights), runs the
module's forward, and leaves them in reverse order however the forward ended, Ctrl-C included (forward hooks
would skip the leave on a KeyboardInterrupt). The units' own wrappers then find their weights in place: this
thread holds their locks, and the streamer counts nested entries (unit.depth), so they neither fetch again nor
release early. streamer.detach() removes these wrappers first (they sit on top of the units' own).
"""
import torch

from ..core._signals import DeferredSigint
from .compiled import runs_eagerly
from .streamer import NO_OWN_FORWARD, OffloadedForward


def _class_names(preload_module_classes):
    if preload_module_classes is None:
        return set()
    if isinstance(preload_module_classes, str):
        return {preload_module_classes}
    if isinstance(preload_module_classes, type):  # one class, as one name is taken
        return {preload_module_classes.__name__}
    names = set()
    if not hasattr(preload_module_classes, "__iter__"):
        raise TypeError(f"preload_module_classes must be class names (str) or classes, in a list, got "
                        f"{type(preload_module_classes).__name__}")
    for c in preload_module_classes:
        if isinstance(c, str):
            names.add(c)
        elif isinstance(c, type):
            names.add(c.__name__)
        else:
            raise TypeError(f"preload_module_classes must hold class names (str) or classes, got {c!r}")
    return names


def check(preload_module_classes):
    """The set of class names; TypeError on anything else."""
    return _class_names(preload_module_classes)


# torch's own modules whose forward reads a submodule's weight directly: preloaded without being named.
# nn.MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward, so it (and nn.Transformer,
# nn.TransformerEncoder/DecoderLayer, built on it) failed on the meta placeholder unless the user knew to name it.
ALWAYS = (torch.nn.MultiheadAttention,)


def attach(streamer, class_names):
    """Wraps the forward of every module of the model whose class is named in `class_names` (or in ALWAYS)."""
    by_module = {id(u.module): u for u in streamer.units}
    for module in streamer.model.modules():
        if type(module).__name__ not in class_names and not isinstance(module, ALWAYS):
            continue
        units = [by_module[id(m)] for m in module.modules() if id(m) in by_module]
        if units:
            wrapper = PreloadForward(streamer, units, module.forward, module)
            previous = module.__dict__.get("forward", NO_OWN_FORWARD)
            module.forward = wrapper
            streamer.handles.append(_Unwrap(module, wrapper, previous))


class _Unwrap:
    """A removable handle (streamer.handles) that puts the module's previous forward back."""

    def __init__(self, module, wrapper, previous):
        self.module, self.wrapper, self.previous = module, wrapper, previous

    def remove(self):
        module = self.module
        if module is None:
            return
        self.module = None
        self.wrapper.pass_through()
        if module.__dict__.get("forward") is not self.wrapper:
            return  # wrapped again since (accelerate's autocast): that stays, and calls ours
        if self.previous is NO_OWN_FORWARD:
            module.__dict__.pop("forward", None)
        else:
            module.forward = self.previous


@runs_eagerly
class PreloadForward(OffloadedForward):
    """The forward of a preload module: every unit under it entered (in module order, parents before children,
    the order in which nested forwards take locks) for the whole call."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        args = self.unbound(args)
        streamer, units = self.streamer, self.unit
        if streamer is None:
            return self.inner(*args, **kwargs)
        return streamer.counted_call(self, lambda: self._preloaded(streamer, units, args, kwargs), args, kwargs)

    def _preloaded(self, streamer, units, args, kwargs):
        taken, entered = [], []
        try:
            for unit in units:
                nested = unit.lock._is_owned()
                # a Ctrl-C lands once `taken` lists the lock, which the except below releases: one landing
                # between the two left it held for good, and other threads' forwards waited forever
                with DeferredSigint():
                    unit.lock.acquire()
                    taken.append(unit)
                if not nested and (unit.depth or unit.fetches or unit.hooks_entered):
                    unit.depth = 1  # stale state of an interrupted call (see OffloadedForward)
                    streamer.leave(unit, None)
                entered.append(unit)  # before enter(): a failing enter() is left too
                streamer.enter(unit)
            output = self.inner(*args, **kwargs)
        except BaseException:
            try:
                for unit in reversed(entered):
                    streamer.leave(unit, None)
            finally:
                for unit in reversed(taken):
                    unit.lock.release()
            raise
        try:
            changed = None
            for unit in reversed(entered):
                try:
                    output = streamer.leave(unit, output, finished=True)
                except RuntimeError as exc:  # a changed buffer, raised once that unit is left: leave the others
                    changed = changed or exc
            if changed is not None:
                raise changed
        finally:
            for unit in reversed(taken):
                unit.lock.release()
        return output
