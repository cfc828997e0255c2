"""A checkpoint's tensors under the names a transformers model gives them.

transformers 5 converts some architectures' checkpoints as it loads them, and converts back as it saves
(save_pretrained writes the original layout): GPT-NeoX's `embed_out` is the model's `lm_head`, ViT's
`encoder.layer.0.attention.attention.query` its `layers.0.attention.q_proj`, and Mixtral's or Qwen2-MoE's
per-expert matrices are concatenated into one fused tensor per layer. A rename only changes where a tensor is
looked up, so swapio reads it in place under the model's name. A merge makes a tensor that no file holds, and
reading in place cannot make it: that is a ValueError naming the tensor and the way out, not a bare "lacks tensor".
A base model read from a directory saved with a head finds its tensors under the base model's prefix, as in
transformers. A peft model reads the checkpoint of the transformers model it wraps (names.py): that model's
conversions apply, to the names its checkpoint would use (no `base_layer`), as for the model unwrapped.
(save_pretrained of an offloaded model writes transformers' saved layout: hf_original_layout.py.)
"""
from .hf_model import is_transformers_model, transformers_model_of
from .names import without_wrappers


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
    model = transformers_model_of(model)
    transforms = None if model is None else _transforms(model)
    if transforms is None:
        return locations
    renamings, converters, rename_source_key = transforms
    own = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    own += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    wanted = dict.fromkeys(without_wrappers(name) for name in own)  # as its checkpoint names them
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
                "then disk_offload(model, offload_dir=...) (written once, in the model's layout); or save it with "
                "save_pretrained(dir, save_original_format=False), the model's layout, which swapio reads in place")
    return out

