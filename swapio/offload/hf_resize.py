"""model.resize_token_embeddings(n) of an offloaded transformers model whose embeddings are offloaded.

transformers builds the new embedding from the old one's values (copies its rows, initialises the new ones from
their mean and covariance), which between forwards is a meta placeholder: it failed with torch's "Tensor.item()
cannot be called on meta tensors", which names neither cause nor cure. While a model is offloaded, its
resize_token_embeddings is this one: a RuntimeError saying what to do, before anything changed, where an
embedding it resizes is offloaded; transformers' own where both are resident (keep_resident).
"""
from .hf_model import ModelMethod
from .units import Placeholder


class ResizeTokenEmbeddings(ModelMethod):
    """The offloaded model's resize_token_embeddings (see the module)."""

    __slots__ = ()
    NAME = "resize_token_embeddings"

    def __call__(self, *args, **kwargs):
        model = self.model()
        for what, get in (("input", model.get_input_embeddings), ("output", model.get_output_embeddings)):
            module = get()
            if module is not None and isinstance(getattr(module, "weight", None), Placeholder):
                raise RuntimeError(
                    f"resize_token_embeddings of a model offloaded by swapio: its {what} embedding's weight is "
                    "offloaded, and the new embedding is built from its values. Resize before offloading, or "
                    "remove_offload(model), resize and offload again, or keep both embeddings resident "
                    "(keep_resident=[...] their module names)")
        return type(model).resize_token_embeddings(model, *args, **kwargs)


install, uninstall = ResizeTokenEmbeddings.install, ResizeTokenEmbeddings.uninstall
