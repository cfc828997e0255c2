"""Whether a model is a transformers PreTrainedModel, without importing transformers; and ModelMethod, the base of
the per-model method overrides (hf_save.py, hf_resize.py) set in its instance __dict__ while it is offloaded."""
import weakref

from .no_copy import refuse_copy
from .wrappers import unwrap


def is_transformers_model(model):
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def transformers_model_of(model):
    """The transformers model `model` is, or the one a peft model wraps (its get_base_model(), whose checkpoint
    it reads: names.py), inside torch.compile's wrapper (wrappers.py) if any; None for another model."""
    model = unwrap(model)
    if is_transformers_model(model):
        return model
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else None
    return inner if inner is not None and is_transformers_model(inner) else None


class ModelMethod:
    """model.<NAME> while the model is offloaded: a subclass defines NAME and __call__ (self.model() is the model,
    held weakly). install() sets it on a transformers model (or the one a peft model wraps: peft's own methods
    reach it, and merge_and_unload() returns it) unless its instance has its own; uninstall() takes back only
    what install() set."""

    __slots__ = ("model",)
    NAME = ""

    def __init__(self, model):
        self.model = weakref.ref(model)

    def __reduce_ex__(self, protocol):
        refuse_copy()

    @classmethod
    def install(cls, model):
        model = transformers_model_of(model)
        if model is not None and cls.NAME not in model.__dict__:
            setattr(model, cls.NAME, cls(model))

    @classmethod
    def uninstall(cls, model):
        model = transformers_model_of(model)
        if model is not None and isinstance(model.__dict__.get(cls.NAME), cls):
            del model.__dict__[cls.NAME]
