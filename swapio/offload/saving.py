"""model.state_dict() of an offloaded model: each offloaded weight is a placeholder that refuses its values.

Between forwards an offloaded attribute holds a meta tensor, so state_dict() can only give that. Code that only
reads names, shapes and dtypes keeps working. Code that wants the values would get torch's "Cannot copy out of
meta tensor" (safetensors, accelerate's save_state, .cpu()) or, worse, write a checkpoint of meta tensors without
a word (torch.save). So each unit's _save_to_state_dict (what every state_dict() calls, whichever module it is
called on) gives an OffloadedValue instead: a meta tensor whose use for anything but its metadata raises a
RuntimeError naming the weight and what saves an offloaded model. state_dict(keep_vars=True) (the parameters
themselves, which swapio's own export reads) and weights fetched inside a forward are left as they are.
"""
import torch

from .loading import unwrap_units, wrap_units
from .no_copy import refuse_copy
from .units import table_of

# What a placeholder answers: its metadata, never values.
_METADATA = {getattr(torch.Tensor, n).__get__ for n in ("shape", "dtype", "device", "is_meta", "ndim", "layout",
                                                         "requires_grad", "is_cuda", "is_sparse", "is_quantized",
                                                         "nbytes", "itemsize", "names", "grad_fn", "is_leaf")
             if hasattr(torch.Tensor, n)}
_METADATA |= {getattr(torch.Tensor, n) for n in ("size", "dim", "numel", "nelement", "element_size", "stride",
                                                  "storage_offset", "is_contiguous", "is_floating_point",
                                                  "is_complex", "__len__", "__repr__", "__format__", "get_device")}


def _message(name):
    return (f"{name} is offloaded by swapio: the model's state_dict() holds a placeholder for it, not its values "
            "(they are in swapio's host copies or offload files), so torch.save(model.state_dict()), "
            "safetensors' save_file and accelerate's Accelerator.save_state() cannot save the model. Save its "
            "weights with swapio.offload.save_checkpoint(model, path) (model.save_pretrained(dir) for a "
            "transformers model), and a swapio optimizer's state with opt.save(dir) (opt.optimizer.save(dir) "
            "after accelerate's prepare), which load() restores, offloaded weights included. With accelerate, "
            "prepare the optimizer, scheduler and dataloaders but not the offloaded model: save_state() and "
            "load_state() then resume it through the optimizer. Or remove_offload(model) first. (accelerate's "
            "cpu_offload, disk_offload and dispatch_model read these values too: the model is offloaded already, "
            "by swapio)")


class OffloadedValue(torch.Tensor):
    """A state_dict() entry of an offloaded weight: its metadata, and a RuntimeError for its values."""

    _swapio_name: str

    @staticmethod
    def of(meta, name):
        value = torch.Tensor._make_subclass(OffloadedValue, torch.Tensor.detach(meta), False)
        value._swapio_name = name
        return value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        name = next((a._swapio_name for a in (*args, *(kwargs or {}).values()) if isinstance(a, OffloadedValue)),
                    "a weight")
        raise RuntimeError(_message(name))

    def __reduce_ex__(self, protocol):  # torch.save and pickle
        raise RuntimeError(_message(self._swapio_name))


class GuardedSave:
    """A unit module's _save_to_state_dict while it is offloaded (see the module)."""

    __slots__ = ("unit", "inner", "own")

    def __init__(self, unit, inner, own):
        self.unit, self.inner, self.own = unit, inner, own

    def __call__(self, destination, prefix, keep_vars):
        self.inner(destination, prefix, keep_vars)
        if keep_vars:
            return
        unit = self.unit
        for attr, kind, slot in unit.entries:
            # what stands for the weight, not its value: the placeholder, or a stand-in (NaN, on the execution
            # device) of a module just wrapped (grafting.py); a weight fetched inside a forward keeps its value
            now = table_of(unit.module, kind).get(attr)
            if prefix + attr in destination and now is not None and (now is slot.placeholder or now is slot.stand_in):
                name = f"{unit.name}.{attr}" if unit.name else attr
                destination[prefix + attr] = OffloadedValue.of(slot.placeholder, name)

    def __reduce_ex__(self, protocol):
        refuse_copy()


def install(streamer):
    wrap_units(streamer, "_save_to_state_dict", GuardedSave)


def uninstall(streamer):
    unwrap_units(streamer, "_save_to_state_dict", GuardedSave)
