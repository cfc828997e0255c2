"""Whether a model is a transformers PreTrainedModel, without importing transformers."""


def is_transformers_model(model):
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)
