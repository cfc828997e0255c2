"""torch.compile of an offloaded model: swapio's boundaries run eagerly, outside the compiled graphs.

An offloaded module's forward (OffloadedForward) puts freshly fetched weights into the module's attributes and
takes them away after, and the model's pre-hook puts placeholders back (grafting._Restore): dynamo tracing
through them captured one call's tensors in the graph, mixed up weights ("mat1 and mat2 shapes cannot be
multiplied" for a model with no such layer), tripped over the weights' views of the ring ("storage_offset() must
be divisible by 4") and recompiled at every forward. So they are torch.compiler.disable()d: the graph breaks
around each offloaded module, which runs as without compile (numbers equal eager), and the code between them
(resident modules, activations, the loss) compiles. fullgraph=True cannot hold: dynamo then raises its error,
with the reason below. The wrapping needs torch._dynamo (about a second to import), which a program that never
compiles does not: it happens as dynamo is imported (torch.compile imports it), by a hook on that one import
(_WhenDynamoLoads), or at once where dynamo is in already. So it holds whatever the order (an optimizer built,
then its step compiled), and costs nothing without compile. The boundary classes name themselves
(@runs_eagerly), so this module imports none of theirs. Activation offload's bookkeeping (its `with`, its
saved-tensor hooks) runs eagerly the same way (@methods_run_eagerly), and so do the hooks that hand trained
weights' gradients to their optimizer (training.py: a backward inside a compiled function runs them under
dynamo) and the offloaded optimizers' step, gradient and state methods (swapio.optim).
"""
import importlib.abc
import importlib.machinery
import sys

import torch

REASON = ("a module offloaded by swapio runs eagerly: its forward swaps the weights in and out, which a graph "
          "cannot hold; compile without fullgraph=True (the graph breaks around each offloaded module)")
_boundaries = []  # (class, method name, recursive, reason) of the methods that run eagerly
_done = False


def runs_eagerly(cls):
    """Class decorator: cls.__call__ is one of swapio's boundaries (left out of compiled graphs from the first
    offload on)."""
    return methods_run_eagerly("__call__", reason=REASON)(cls)


def methods_run_eagerly(*names, reason, recursive=True):
    """Class decorator: the methods `names` run eagerly from the first offload on; recursive=False compiles what
    they call all the same (only their own frame is left out)."""
    def mark(cls):
        for name in names:
            _boundaries.append((cls, name, recursive, reason))
            if _done:  # a class defined after the first offload
                _disable(cls, name, recursive, reason)
        return cls
    return mark


def _disable(cls, name, recursive, reason):
    method = cls.__dict__[name]
    try:
        setattr(cls, name, torch.compiler.disable(method, recursive=recursive, reason=reason))
    except TypeError:  # torch < 2.7 takes no reason
        setattr(cls, name, torch.compiler.disable(method, recursive=recursive))


def leave_out_of_graphs():
    """Marks swapio's boundaries (once per process) so that torch.compile runs them eagerly."""
    global _done
    if _done:
        return
    for boundary in _boundaries:
        _disable(*boundary)
    _done = True


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the import of torch._dynamo it has the usual finders find it, and has its loader
    run leave_out_of_graphs() once the module is in (then it leaves sys.meta_path)."""
    NAME = "torch._dynamo"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        _unhook()
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_mark(module):
            exec_module(module)
            leave_out_of_graphs()

        spec.loader.exec_module = exec_then_mark  # (this module's loader only: one per module)
        return spec


_hook = _WhenDynamoLoads()


def _unhook():
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def mark_when_dynamo_loads():
    """At swapio's import: the boundaries are marked as soon as torch._dynamo is (see the module)."""
    if _WhenDynamoLoads.NAME in sys.modules:
        leave_out_of_graphs()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def is_compile_wrapper(module):
    """True for torch.compile's wrapper module (OptimizedModule), which registers the compiled model as its
    `_orig_mod` submodule: not a wrapper that needs stand-ins (grafting.py)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


mark_when_dynamo_loads()
