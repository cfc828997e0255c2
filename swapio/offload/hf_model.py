"""Whether a model is a transformers PreTrainedModel, without importing transformers; and the per-model method
overrides (hf_save.py, hf_resize.py) set in its instance __dict__ while it is offloaded."""


def is_transformers_model(model):
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def install_method(model, name, cls):
    """model.<name> = cls(model) on a transformers model, unless its instance already has its own."""
    if is_transformers_model(model) and name not in model.__dict__:
        setattr(model, name, cls(model))


def uninstall_method(model, name, cls):
    """Takes back what install_method set (an instance of cls), nothing else."""
    if isinstance(model.__dict__.get(name), cls):
        del model.__dict__[name]
