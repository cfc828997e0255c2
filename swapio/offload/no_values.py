"""What is computed from an offloaded weight between forwards: meta tensors that must never meet real values.

Between forwards an offloaded parameter is a meta placeholder (units.Placeholder), and torch computes with meta
tensors without a word (shapes only). Worse, some of its in-place ops on a real tensor given a meta operand do
nothing at all: `total += p.pow(2).sum()` (an L2 penalty, a weight norm logged) and an EMA's
`ema.mul_(d).add_(p, alpha=1 - d)` left the real tensor as it was, a silently wrong loss or average. So an op on a
placeholder gives a NoValues meta tensor, which carries this through further ops (shapes still compute), and an
op that would give a real tensor from one (or that torch refuses with its meta-device error) is a RuntimeError
naming the weight. Ops that only read metadata (`.shape`, `.grad`, `torch.zeros_like(p, device=...)`,
`p.new_zeros(...)`) work as on any tensor.
"""
import torch

from .._torch_floor import parse as _torch_version
from .compiled import methods_run_eagerly


# the tensor attributes that are views of its values (the rest, .shape, .grad, .device, are metadata); .data too:
# a plain meta tensor from it (an EMA's `add_(b.data)` of a buffer) would let an in-place op do nothing again
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag", "data"}


def _kind(func):
    """"metadata": reads none of a tensor's values; "factory": makes a tensor from its metadata only
    (torch.zeros_like(p, device=...), p.new_zeros(...)); "values": anything else."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return "values" if getattr(getattr(func, "__self__", None), "__name__", "") in _VIEW_ATTRIBUTES else "metadata"
    if name in ("__set__", "__repr__", "__format__"):
        return "metadata"
    return "factory" if name.endswith("_like") or name.startswith("new_") else "values"


def _flat(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _without_values(t):
    # called with subclass dispatch disabled: is_meta of a Placeholder would come back here otherwise
    return isinstance(t, torch.Tensor) and getattr(type(t), "carries_no_values", False) and t.is_meta


# p.grad = None (model.zero_grad()) in a compiled step comes here as a call of the getset descriptor's __set__:
# torch 2.14's dynamo fails on that call (InternalTorchDynamoError: GetSetDescriptorVariable has no
# tp_descr_set_impl), where 2.11-2.13 trace it. There it runs eagerly instead (a graph break, same values).
_DESCRIPTOR_SET_FAILS_IN_DYNAMO = _torch_version(str(torch.__version__)) >= (2, 14)


@methods_run_eagerly("set", reason="swapio sets p.grad of an offloaded weight eagerly on torch >= 2.14")
class _EagerSet:
    def set(self, func, args, kwargs):
        return func(*args, **kwargs)


_EAGER = _EagerSet()


def call(func, args, kwargs):
    """func(*args, **kwargs) for __torch_function__ of a tensor that may hold no values (see the module)."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():  # then as plain tensors' (written so dynamo traces it)
        kind = _kind(func)
        if _DESCRIPTOR_SET_FAILS_IN_DYNAMO and torch.compiler.is_compiling() and \
                getattr(func, "__name__", "") == "__set__":
            return _EAGER.set(func, args, kwargs)
        if kind == "metadata" or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        source = next((t for t in _flat(args, kwargs) if _without_values(t)), None)
        if source is None:
            return func(*args, **kwargs)
        try:
            result = func(*args, **kwargs)
        except RuntimeError as e:  # NotImplementedError ("Cannot copy out of meta tensor") is one too
            if "meta" not in str(e).lower():
                raise
            raise RuntimeError(_message(source, func)) from e
        given = {id(t) for t in _flat(args, kwargs) if isinstance(t, torch.Tensor)}
        return _carry(result, source, func, given, kind == "factory")


def _carry(result, source, func, given, factory):
    if isinstance(result, (list, tuple)):
        items = [_carry(r, source, func, given, factory) for r in result]
        return items if type(result) is list else (tuple(items) if type(result) is tuple else type(result)(items))
    if not isinstance(result, torch.Tensor):
        return result
    if not result.is_meta:
        if factory:
            return result
        raise RuntimeError(_message(source, func))  # values from a tensor without any: an in-place op did nothing
    if id(result) in given or type(result) is not torch.Tensor:
        return result  # an in-place op on a meta tensor returns it; subclasses (a grad marker) stay as they are
    out = result.as_subclass(NoValues)
    out.weight_name = source.weight_name
    return out


def _message(source, func):
    name = getattr(func, "__name__", str(func))
    return (f"{name}() used {source.weight_name}, which is offloaded by swapio: between forwards what "
            "model.parameters() (or buffers()) yields for it is a meta placeholder holding no values (and so is "
            "anything computed from it), so torch would compute nothing from it (an in-place op such as "
            "`total += p.pow(2).sum()` or an EMA's `ema.add_(p)` would leave the real tensor as it was). Compute "
            "from a weight inside its module's forward, where it has its values (its forward pre-hooks run before "
            "swapio brings them in, its forward hooks after they left); read a trained weight's current value "
            "with the swapio optimizer's opt.param_value(p); or keep the module resident (keep_resident=[...]) "
            "or remove_offload(model) first")


def refuse_pickle(name):
    return (f"{name} is offloaded by swapio: between forwards the tensor that stands for it holds no values, so "
            "pickling it (torch.save of a parameter or buffer, of dict(model.named_parameters()) or "
            "named_buffers()) would save none. Save the model's weights with swapio.offload.save_checkpoint(model, "
            "path) (model.save_pretrained(dir) for a transformers model), read a trained weight's value with the "
            "swapio optimizer's opt.param_value(p), or remove_offload(model) first")


class NoValues(torch.Tensor):
    """A meta tensor computed from an offloaded weight's placeholder between forwards, or an offloaded buffer's
    placeholder; `weight_name` names the weight."""

    carries_no_values = True
    weight_name = "an offloaded weight"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return call(func, args, kwargs)

    def __reduce_ex__(self, protocol):
        raise RuntimeError(refuse_pickle(self.weight_name))
