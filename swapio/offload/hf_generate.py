"""model.generate() of an offloaded transformers model whose first parameter is offloaded: an error on a meta
tensor says why and what to do.

model.device is the device of the model's first parameter, a meta placeholder while it is offloaded, and
transformers builds some tensors on model.device itself: assisted generation and prompt lookup move their
candidates there, generate() without input_ids builds its start token there, a static cache with
prefill_chunk_size is allocated there, Whisper builds its start tokens there. These failed with torch's
"Tensor.item() cannot be called on meta tensors" (or swapio's meta-input error, which could not know it came
from generate), naming neither cause nor cure. While a model is offloaded, its generate is transformers' own
inside this one, which turns such an error into a RuntimeError naming the module to keep resident
(keep_resident=[...]: model.device is then the execution device, and every such path computes as resident).
"""
import re

from .hf_model import ModelMethod
from .registry import offloaded


_META = re.compile(r"\bmeta\b")  # the device, not "metadata"


class ModelDeviceError(RuntimeError):
    """Raised once, by the innermost offloaded generate (an assistant_model's runs inside the main model's)."""


class Generate(ModelMethod):
    """The offloaded model's generate (see the module)."""

    __slots__ = ()
    NAME = "generate"

    def __call__(self, *args, **kwargs):
        model = self.model()
        try:
            return type(model).generate(model, *args, **kwargs)
        except ModelDeviceError:
            raise
        except (RuntimeError, NotImplementedError) as e:
            first = next(model.named_parameters(), None)
            if not _META.search(str(e)) or first is None or first[1].device.type != "meta":
                raise
            module = first[0].rpartition(".")[0]
            device = getattr(offloaded.get(model), "device", "the execution device")
            raise ModelDeviceError(
                f"generate() of a {type(model).__name__} offloaded by swapio (the model generating, or the "
                "assistant_model of assisted generation, whose generate() it calls) failed on a tensor on the meta device: model.device is "
                f"the device of the model's first parameter ({first[0]}), an offloaded placeholder, and transformers "
                "builds some tensors on model.device (assisted generation and prompt lookup, generate() without "
                "input_ids, a static cache with prefill_chunk_size, models such as Whisper). Keep the module that "
                f"owns the first parameter resident, keep_resident=[{module!r}], and model.device is the execution "
                f"device ({device}); inputs moved to model.device (a pipeline given device=-1 moves them there) go to the "
                f"execution device instead (pipeline(..., device={str(device)!r})). "
                f"({type(e).__name__}: {e})") from e


install, uninstall = Generate.install, Generate.uninstall
