"""DistributedDataParallel and DataParallel over offloaded weights: refused both ways round.

DDP all-reduces gradients through hooks on the parameters, which an offloaded module does not compute with (it
fetches the weights): each process would train its own weights without a word. DataParallel would copy the meta
placeholders to each GPU. So offloading a model that holds either wrapper is refused before anything changes
(refuse_wrapped). Wrapping an offloaded model instead fails inside torch when DDP broadcasts into the
placeholders, unless it is built with init_sync=False; then its forward is refused (WrappedForwardCheck, from
the offloaded model's forward pre-hook) when it could train offloaded weights; one without gradients computes what
it would without DDP, and runs. (DDP itself refuses a model holding both resident parameters and placeholders,
whose devices differ, and one whose parameters are all frozen.)
"""
import weakref

import torch

_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)


def _not_supported(wrapper_name, way_out):
    return ValueError(f"{wrapper_name} over offloaded weights is not supported: its gradients would not be "
                      "synchronized (an offloaded module computes with weights it fetches, not with the parameters "
                      f"{wrapper_name} hooks), so each process would train apart. {way_out}")


def refuse_wrapped(model):
    """A ValueError naming the wrapper when `model` is, or holds, DistributedDataParallel or DataParallel."""
    for name, m in model.named_modules():
        if isinstance(m, _WRAPPERS):
            kind, where = type(m).__name__, f"{name}.module" if name else "model.module"
            raise _not_supported(kind, f"Offload the model it wraps ({where}) and run it without {kind}: for "
                                       "inference it adds nothing, and training offloaded weights runs on one process")


class WrappedForwardCheck:
    """Refuses a forward of the offloaded `model` as a DataParallel replica, or inside the forward of a
    DistributedDataParallel that holds it (torch marks the DDP object whose forward runs: `_active_ddp_module`)
    when gradients are on and an offloaded weight (of `slots`) is trainable. Which DDP objects do not hold the
    model is remembered: a forward outside DDP, or under one of those, pays an attribute read."""

    __slots__ = ("model", "slots", "_apart")

    def __init__(self, model, slots):
        self.model, self.slots = model, slots
        self._apart = weakref.WeakSet()  # DDP objects whose forward ran this model without holding it

    def __call__(self, module):
        if module.__dict__.get("_is_replica", False):  # (set by DataParallel's replicate)
            raise _not_supported("DataParallel", "Run the offloaded model without DataParallel")
        ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
        if ddp is None or ddp in self._apart:
            return
        if not any(m is self.model for m in ddp.module.modules()):
            self._apart.add(ddp)
        elif torch.is_grad_enabled() and any(s.is_param and s.requires_grad for s in self.slots):
            raise _not_supported("DistributedDataParallel", "Run the offloaded model without "
                                 "DistributedDataParallel: training offloaded weights runs on one process")
