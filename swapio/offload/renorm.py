"""Modules whose forward changes their own weight in place: torch's Embedding and EmbeddingBag with max_norm.

Such a module renormalizes the rows it looks up, in place, in every forward (torch.embedding_renorm_), so on a
resident model the stored weight changes: later forwards of modules tied to it see the renormalized rows, and an
optimizer steps from them. Offloaded, the change lands in the fetched copy (the ring, a device copy) and is lost:
the next forward reads the stored weight again, and a swapio optimizer's fp32 master never sees it, so training
diverged from the resident model without a word. Offloading such a module is refused; it stays resident with
keep_resident.
"""
import torch


def check_offloaded(units):
    """ValueError naming the first offloaded module that renormalizes its weight in its forward."""
    for unit in units:
        module = unit.module
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.max_norm is not None:
            raise ValueError(
                f"{unit.name or 'the model'} is a torch.nn.{type(module).__name__} with max_norm="
                f"{module.max_norm}, whose forward renormalizes its weight in place: offloaded, the change would be "
                "lost (the next forward reads the stored weight again, and an optimizer steps from its own copy), "
                f"so the model would drift from the resident one. Keep it resident (keep_resident=[{unit.name!r}]), "
                "or offload a copy without max_norm")
