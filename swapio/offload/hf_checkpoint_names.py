"""A checkpoint's tensors under the names a transformers model gives them.

transformers 5 converts some architectures' checkpoints as it loads them, and converts back as it saves
(save_pretrained writes the original layout): GPT-NeoX's `embed_out` is the model's `lm_head`, ViT's
`encoder.layer.0.attention.attention.query` its `layers.0.attention.q_proj`, and Mixtral's or Qwen2-MoE's
per-expert matrices are concatenated into one fused tensor per layer. A rename only changes where a tensor is
looked up, so swapio reads it in place under the model's name. A merge makes a tensor that no file holds, and
reading in place cannot make it: that is a ValueError naming the tensor and the way out, not a bare "lacks tensor".
A base model read from a directory saved with a head finds its tensors under the base model's prefix, as in
transformers. save_pretrained of an offloaded model writes the renamed tensors back under transformers' saved names.
"""
from .hf_model import is_transformers_model


def _transforms(model):
    """(renamings, converters, transformers' rename_source_key) of what transformers applies when it loads
    `model`; None for a transformers without them (before 5) or another model."""
    if not is_transformers_model(model):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters, rename_source_key


def as_model_names(model, locations):
    """{name: Location} of a checkpoint with each tensor (also) under the name `model` loads it as: renamed, and
    with the base model's prefix stripped or added as transformers does (BertModel from a BertForMaskedLM
    directory: `bert.embeddings...` is `embeddings...`). A tensor that transformers would merge with others into
    one of the model's tensors is a ValueError."""
    transforms = _transforms(model)
    if transforms is None:
        return locations
    renamings, converters, rename_source_key = transforms
    wanted = dict.fromkeys(name for name, _ in model.named_parameters(remove_duplicate=False))
    wanted.update(dict.fromkeys(name for name, _ in model.named_buffers(remove_duplicate=False)))
    present = dict.fromkeys(wanted, True)  # rename_source_key asks .get(name) is not None
    prefix = getattr(model, "base_model_prefix", None) or None
    out, merged = dict(locations), {}
    for name, loc in locations.items():
        new, converter = rename_source_key(name, renamings, converters, prefix, present)
        if converter is not None:
            merged.setdefault(new, []).append(name)
        elif new != name and new not in locations:
            out[new] = loc
    for target, sources in merged.items():
        if target in wanted and target not in locations:
            shown = ", ".join(repr(s) for s in sorted(sources)[:3]) + (", ..." if len(sources) > 3 else "")
            raise ValueError(
                f"{getattr(locations, 'path', 'the checkpoint')}: the model's tensor {target!r} is not in the "
                f"checkpoint: transformers makes it when loading by merging {len(sources)} tensors ({shown}), "
                f"the {model.config.model_type} checkpoint layout that save_pretrained writes. swapio reads a "
                "checkpoint in place and cannot merge tensors: load the model with transformers' from_pretrained, "
                "then disk_offload(model, offload_dir=...) (written once, in the model's layout)")
    return out


def original_names(model):
    """The function giving a model tensor's name in the layout transformers' save_pretrained writes
    (save_original_format): the renames transformers' loading applies, reversed. None when there are none, and
    when some tensor is a merge (Mixtral's fused experts): splitting it is not a rename, so the model's own layout
    is written, which transformers loads as it is."""
    if not is_transformers_model(model):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, apply_renamings
    except ImportError:
        return None
    transforms = getattr(model, "_weight_conversions", None)  # what from_pretrained applied, as transformers reads
    if transforms is None:  # built another way: the mapping, without the legacy renames and prefix changes
        transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                      if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in transforms[::-1]]
    if any(isinstance(t, WeightConverter) for t in reverse):
        return None
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    return (lambda name: apply_renamings(name, renamings)) if renamings else None
