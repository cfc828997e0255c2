"""Copying or pickling an offloaded model is refused: its wrappers and hooks raise this."""


def refuse_copy():
    """The TypeError of copying an offloaded model (its wrappers and hooks raise it when copied or pickled)."""
    raise TypeError("a model offloaded by swapio cannot be copied or pickled (copy.deepcopy, pickle, torch.save "
                    "of the model object): the copy would read the original's weights through the original's "
                    "hooks. Copy it before offloading, or remove_offload(model), copy it, and offload each "
                    "copy (each to its own offload_dir). A module holding no offloaded weights copies fine: "
                    "peft's modules_to_save (which deep-copies its modules) works on modules kept resident "
                    "(keep_resident=[...]) or with get_peft_model before offloading")
