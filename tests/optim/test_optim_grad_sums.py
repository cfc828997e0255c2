"""The fp32 gradient sums in a file (offload="nvme" training offloaded weights): the first gradient of a step is
summed without a second copy of it (the norm a clip needs comes from the gradient itself, which the sum holds
exactly), and the norms kept equal torch's for a .grad of the weight's dtype, first gradient or summed."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swapio.optim.grad_store import FileGrads

N = 1 << 16


class LargestNew(TorchDispatchMode):
    """The largest tensor any op made while active (bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and func._schema.name not in ("aten::view", "aten::slice"):
                if t.untyped_storage().data_ptr() not in self.inputs:
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out

    def watch(self, *tensors):
        self.inputs = {t.untyped_storage().data_ptr() for t in tensors}
        return self


def test_first_gradient_is_summed_without_a_copy(tmp_path):
    grads = FileGrads(str(tmp_path), {})
    try:
        p = torch.nn.Parameter(torch.empty(N, dtype=torch.bfloat16), requires_grad=False)
        g = torch.randn(N).to(torch.bfloat16)
        grads.add(torch.nn.Parameter(torch.empty(N, dtype=torch.bfloat16)), g)  # the pinned buffers exist now
        grads.add(torch.nn.Parameter(torch.empty(N, dtype=torch.bfloat16)), g)
        buffers = [b.at_least(1) for b in grads._buffers]
        with LargestNew().watch(g, *buffers) as mode:
            grads.add(p, g)
        assert mode.largest < N  # a scalar norm; no copy of g (2N bytes) nor of its sum (4N)
        want = torch.nn.utils.get_total_norm([g])  # torch's norm of a bf16 .grad holding g
        assert torch.equal(grads.norms([p])[p], want)
        g2 = torch.randn(N).to(torch.bfloat16)
        grads.add(p, g2)  # a second gradient: the norm of the sum rounded to bf16, as a .grad would hold it
        summed = (g.float() + g2.float()).to(torch.bfloat16)
        assert torch.equal(grads.norms([p])[p], torch.nn.utils.get_total_norm([summed]))
    finally:
        grads.close()
