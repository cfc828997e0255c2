"""model._optimize_model_for_decode of an offloaded transformers model computing on the CPU.

transformers' generate() switches MoE experts from grouped_mm to batched_mm for its decode steps when
model.device is not the CPU (batched_mm is faster on accelerators). model.device is the first parameter's: a
meta placeholder for an offloaded model, so a model computing on the CPU decoded with batched_mm, whose rounding
differs: every decode step's scores differed from the resident model's in the last bits, without a word. While
offloaded, the decision follows the execution device: on the CPU no switch (what transformers does for a model
resident there), elsewhere transformers' own method (meta is not the CPU either, so it switches as it would).
"""
import contextlib

from .hf_model import ModelMethod, transformers_model_of
from .registry import offloaded


class OptimizeModelForDecode(ModelMethod):
    """The offloaded model's _optimize_model_for_decode (see the module)."""

    __slots__ = ()
    NAME = "_optimize_model_for_decode"

    def __call__(self, *args, **kwargs):
        model = self.model()
        device = getattr(offloaded.get(model), "device", None)
        if device is not None and device.type == "cpu":
            return contextlib.nullcontext()
        return type(model)._optimize_model_for_decode(model, *args, **kwargs)

    @classmethod
    def install(cls, model):
        # only where transformers has the method (a version without it never switches)
        inner = transformers_model_of(model)
        if inner is not None and callable(getattr(type(inner), cls.NAME, None)):
            super().install(model)


install, uninstall = OptimizeModelForDecode.install, OptimizeModelForDecode.uninstall
