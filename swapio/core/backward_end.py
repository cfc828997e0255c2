"""When the running backward ends, and whether it raised: autograd calls a final callback at its end, and frees
it uncalled when the backward raised, before the error reaches the caller."""
import weakref

import torch


class _BackwardEnd:
    __slots__ = ("method", "args", "ran")

    def __init__(self, method, args):
        self.method, self.args, self.ran = weakref.WeakMethod(method), args, False

    def _done(self, ended):
        self.ran = True
        method = self.method()
        if method is not None:  # (its object may be gone: nothing to tell)
            method(*self.args, ended)

    def __call__(self):
        self._done(True)

    def __del__(self):
        if not self.ran:
            self._done(False)


def on_backward_end(method, *args) -> bool:
    """method(*args, ended) runs once the running backward ends (ended=True) or raised (False), on autograd's
    thread, unless method's object was freed by then (the bound method is held weakly, so the backward keeps no
    optimizer or model alive). Returns False, without calling it, when no backward is running here."""
    end = _BackwardEnd(method, args)
    try:
        torch.autograd.Variable._execution_engine.queue_callback(end)
    except RuntimeError:  # not inside a backward
        end.ran = True
        return False
    return True
