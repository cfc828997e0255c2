"""One parameter's share of a step, as the optimizer hands it to a state backend."""
import torch

from ..core import cuda_copy
from .params import LOW_PRECISION, needs_master, on_gpu, shard


class Work:
    """One parameter to step: its gradient, its state `fields` (rule.fields), the rule's `update` and the group's
    `hyper` (rule.hyper). The gradient is given, not read from p.grad, so a caller other than step() (a hook
    that steps a module as soon as its gradient is complete, a gradient accumulated beside the state) can hand
    in its own. seed: the parameter's seed of bf16 stochastic rounding (its index in the optimizer); nonfinite:
    the step's int64 counter of non-finite int8 moments, or None. The backend sets `done` once the parameter is
    fully stepped (its state stored where it lives) and, for a parameter's first step, puts its new state
    tensors in `created` (cpu mode); the optimizer then advances the count (OffloadOptimizer._commit)."""

    __slots__ = ("p", "t", "numel", "grad", "dst", "tmp", "src", "step", "fields", "update", "hyper", "new", "cuda",
                 "master", "low", "edited", "adopted", "seed", "nonfinite", "done", "created", "started", "external", "grad_source")

    def __init__(self, p, grad, step, fields, update, hyper, new, edited=False, seed=0, nonfinite=None, data=None):
        # p: the parameter (the state's key); t: the tensor stepped. data: for an offloaded weight (p is its meta
        # placeholder), the CPU tensor that receives the new compute-dtype values (and holds the current ones)
        self.external = data is not None
        t = data if self.external else shard(p)
        self.p, self.t, self.numel, self.step, self.new = p, t, t.numel(), step, new
        self.seed, self.nonfinite = seed, nonfinite
        self.done, self.created = False, None
        self.started = False  # some segment was updated (run_segment): with done False, the parameter is torn
        self.edited = edited  # changed outside the optimizer since its last step: adopt the new values first
        self.adopted = False  # some elements did differ from the master (set by adopt_edits)
        self.fields, self.update, self.hyper = fields, update, hyper
        self.cuda = on_gpu(t)
        self.master = self.external or needs_master(t)  # an offloaded weight's master is the optimizer's
        self.low = t.dtype in LOW_PRECISION
        self.grad_source = grad  # the gradient as given (a copy of it made in backward is matched against it)
        g = shard(grad).detach()
        self.grad = g.view(-1) if g.is_contiguous() else g.contiguous().view(-1)
        data = t.detach()
        if data.is_contiguous():
            self.dst, self.tmp, self.src = data.view(-1), None, data.view(-1)
        else:  # written into a contiguous temporary, copied into the parameter after its last segment
            if self.cuda:  # written and read on the copy stream only: its memory, which the caching allocator hands
                # out only once that stream is done with it (not a block that compute kernels queued still use)
                with torch.cuda.stream(cuda_copy.copy_stream(t.device)):
                    self.tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            else:
                self.tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self.dst = self.tmp.view(-1)
            self.src = data.contiguous().view(-1) if new or edited else None

    def finish(self):
        if self.tmp is not None:
            self.t.detach().copy_(self.tmp)
