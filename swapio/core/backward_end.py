"""When the running backward ends, and whether it raised: autograd calls a final callback at its end, and frees
it uncalled when the backward raised, before the error reaches the caller."""
import torch


class _BackwardEnd:
    __slots__ = ("done", "ran")

    def __init__(self, done):
        self.done, self.ran = done, False

    def __call__(self):
        self.ran = True
        self.done(True)

    def __del__(self):
        if not self.ran:
            self.ran = True
            self.done(False)


def on_backward_end(done) -> bool:
    """done(ended) runs once the running backward ends (True) or raised (False), on autograd's thread. Returns
    False, without calling done, when no backward is running here."""
    end = _BackwardEnd(done)
    try:
        torch.autograd.Variable._execution_engine.queue_callback(end)
    except RuntimeError:  # not inside a backward
        end.ran = True
        return False
    return True
