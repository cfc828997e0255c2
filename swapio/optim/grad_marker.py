"""p.grad of an offloaded weight: a marker that shows the optimizer holds a gradient for it, and has no values.

An offloaded weight's placeholder is a meta tensor and its gradient lives in the optimizer (an fp32 sum in RAM
or on disk, or, with in_backward=True, already applied), so .grad can only say whether there is one, as torch's
.grad does: model.zero_grad() (p.grad = None) drops it, p.grad.zero_() zeroes it (OffloadedParams reads both
from the marker). Anything that would need the values, torch.nn.utils.clip_grad_norm_ (and accelerate's, which
calls it) first, raises a RuntimeError naming opt.clip_grad_norm_, instead of computing with a meta tensor and
silently changing nothing.
"""
import torch

# What may touch a marker: reading its metadata, dropping its autograd history, zeroing it (zero_grad with
# set_to_none=False, or a hook); everything else would compute with values it does not have.
# storage_offset, is_conj and is_neg: what dynamo reads of a tensor it meets (model.zero_grad() inside a compiled
# training step reads p.grad), which failed the compile with this module's error, naming model.zero_grad() as the way.
_ALLOWED = {"__get__", "__set__", "__repr__", "__format__", "_is_view", "detach_", "requires_grad_", "zero_",
            "_foreach_zero_", "size", "dim", "numel", "nelement", "stride", "is_contiguous", "element_size",
            "is_floating_point", "is_complex", "data_ptr", "untyped_storage", "__reduce_ex__", "__deepcopy__",
            "storage_offset", "is_conj", "is_neg"}


class GradMarker(torch.Tensor):
    """A meta tensor shaped like the weight; `weight_name` names the weight in errors."""

    weight_name = "?"

    @property  # type: ignore[override]
    def data(self):
        """A marker too, sharing this one's version counter. torch's `.data` is a plain meta tensor with a counter
        of its own, so the older habits `p.grad.data.zero_()` (zeroing) and `p.grad.data.div_(n)` (scaling for
        accumulation, clipping by hand) changed nothing, without a word: the step used the gradient as it was.
        Now zeroing through it counts as p.grad.zero_() does, and the rest raises this module's error."""
        with torch._C.DisableTorchFunctionSubclass():
            plain = torch.Tensor.detach(self)  # (shares the version counter, unlike torch's .data)
        out = torch.Tensor._make_subclass(GradMarker, plain)
        out.weight_name = self.weight_name
        return out

    @data.setter
    def data(self, value):
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in _ALLOWED:
            markers = [a for a in _flat(args, kwargs) if isinstance(a, GradMarker)]
            weight = markers[0].weight_name if markers else "?"
            raise RuntimeError(
                f"{name or func}() on p.grad of the offloaded weight {weight!r}: its gradient lives in the swapio "
                "optimizer that trains it (p.grad only marks that there is one; it has no values). "
                f"{_instead(name)}; to drop or zero it, model.zero_grad() and p.grad.zero_() work")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _instead(name):
    """What to do instead of the habit that called `name` (advice for another clipping would mislead)."""
    if "clamp" in name or name.startswith("clip"):  # torch.nn.utils.clip_grad_value_
        return ("torch.nn.utils.clip_grad_value_ cannot clamp it: clamp each backward's gradient with a hook, "
                "p.register_hook(lambda g: g.clamp(-v, v)), which with one backward per step is clip_grad_value_ "
                "exactly, or clip by norm with opt.clip_grad_norm_(max_norm)")
    if "unscale" in name:  # torch.amp.GradScaler's unscale_ (also called by scaler.step)
        return ("torch.amp.GradScaler cannot unscale it: train with torch.autocast(dtype=torch.bfloat16), which "
                "needs no loss scaling and no GradScaler")
    if name.strip("_").startswith(("mul", "div", "imul", "itruediv", "foreach_mul", "foreach_div")):
        return ("To scale it (gradient accumulation, averaging, clipping by hand), scale the loss before backward, "
                "(loss / n).backward(), or each backward's gradient with a hook, p.register_hook(lambda g: g / n); "
                "to clip by norm, call opt.clip_grad_norm_(max_norm)")
    return ("To clip, call opt.clip_grad_norm_(max_norm) instead of torch.nn.utils.clip_grad_norm_ or "
            "accelerator.clip_grad_norm_ (the same global norm, over every gradient the optimizer owns)")


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def new_marker(p, weight_name):
    marker = torch.Tensor._make_subclass(GradMarker, torch.empty_like(p))
    marker.weight_name = weight_name
    return marker
