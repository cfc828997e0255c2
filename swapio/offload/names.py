"""The names a model tensor may have in a checkpoint saved from the plain model.

peft wraps a transformers model without changing its checkpoint: `PeftModel` puts `base_model.model.` in front of
every name (`base_model.` for prompt learning, which wraps the model itself), each adapted layer keeps the
original module as `base_layer` (`...q_proj.base_layer.weight`), and each module of modules_to_save keeps it as
`original_module` (`classifier.original_module.weight`, the trainable copy beside it), while the checkpoint,
written by the plain model's save_pretrained, says `...q_proj.weight`. Looking a tensor up under these aliases
too lets a peft-wrapped model be offloaded from the base model's checkpoint.
"""
PEFT_PREFIXES = ("base_model.model.", "base_model.")
PEFT_WRAPPERS = (".base_layer.", ".original_module.")


def without_wrappers(name):
    """name without peft's module wrappers (`q_proj.base_layer.weight` is `q_proj.weight`)."""
    for wrapper in PEFT_WRAPPERS:
        while wrapper in "." + name:
            name = ("." + name).replace(wrapper, ".", 1)[1:]
    return name


def aliases(name):
    """`name` first, then the names a plain model's checkpoint would use for the same tensor (one per peft prefix
    it may have: `base_model.model.model.layers...` is a LoRA Llama's `model.layers...`, or a prompt-learning
    one's `model.model.layers...`)."""
    out = [name]
    for stripped in [name[len(p):] for p in PEFT_PREFIXES if name.startswith(p)] or [name]:
        stripped = without_wrappers(stripped)
        if stripped not in out:
            out.append(stripped)
    return out


def checkpoint_names(names):
    """Every alias of every name (a tied tensor has several), each once, the model's own names first."""
    out = list(names)
    for n in names:
        for a in aliases(n)[1:]:
            if a not in out:
                out.append(a)
    return out


def find(locations, name):
    """The checkpoint's entry for a model tensor name, under any alias; None if it holds none."""
    for a in aliases(name):
        loc = locations.get(a)
        if loc is not None:
            return loc
    return None
