"""What a model built without weights needs before its weights can come from a checkpoint.

A model built on meta (`with torch.device("meta")`, transformers' from_config there, accelerate's
init_empty_weights) lacks two things that no checkpoint supplies:
- Non-persistent buffers, such as the rotary embedding's `inv_freq` of Llama, Qwen2 and Mistral: computed in the
  constructor and never saved. Under `torch.device("meta")` the constructor computed them on meta. They are
  computed again the way transformers' own from_pretrained does (it builds on meta too): the buffer gets real
  memory and the model's `_init_weights(module)` fills it (for RotaryEmbedding modules it recomputes `inv_freq`
  from the config). The owner must have no parameter with real values, which `_init_weights` would overwrite.
  To tell "filled" from "left alone", the memory starts as NaN (integers: their minimum); a buffer still holding
  it is reported. accelerate's init_empty_weights() leaves buffers real, so there is nothing to do then.
- Parameters transformers never saves (a model's _keys_to_ignore_on_save: Marian's sinusoidal position
  embeddings), which its loading computes: computed the same way when on meta, and kept resident (no checkpoint
  holds them).
- Ties. save_pretrained stores a tied weight under one name (Qwen2's `model.embed_tokens.weight`, not
  `lm_head.weight`). A model built under init_empty_weights() has the tie broken (accelerate re-registers the
  tied parameter as a new meta tensor), so the other name finds nothing. transformers' `tie_weights` is called
  with the names the checkpoint lacks (`missing_keys`, so it ties towards the name that is there either way).
Only transformers models (with `config` and `_init_weights` / `tie_weights`) are handled; peft's wrapper is
looked through (`get_base_model()`). Other models must come with real non-persistent buffers; disk_offload
then raises a ValueError naming the buffer and the ways out.
"""
import torch

from .names import aliases, find
from .hf_model import transformers_model_of


def retie(model, locations):
    """Ties transformers' tied weights again when the checkpoint holds one of the names only."""
    root = transformers_model_of(model)
    if root is None or not callable(getattr(root, "tie_weights", None)):
        return
    missing = {n for n, _ in root.named_parameters(remove_duplicate=False) if find(locations, n) is None}
    tied = getattr(root, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        if not missing & (set(tied) | set(tied.values())):
            return
        root.tie_weights(missing_keys=missing)
    elif missing:  # transformers 4: no mapping and no missing_keys argument
        root.tie_weights()


def _sentinel(t):
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return float("nan")
    if t.dtype == torch.bool:
        return None
    return torch.iinfo(t.dtype).min


def _still_sentinel(t, value):
    if isinstance(value, float):
        return bool(torch.isnan(t).any())
    return bool((t == value).any())


def compute_buffers(model, locations):
    """Computes the non-persistent buffers on meta that the checkpoint lacks; returns the names of those it could
    not compute (left on meta)."""
    pending = {}  # module -> [(table kind, attribute, qualified name)]
    for mname, module in model.named_modules():
        for attr in module._non_persistent_buffers_set:
            b = module._buffers.get(attr)
            name = f"{mname}.{attr}" if mname else attr
            if b is not None and b.device.type == "meta" and find(locations, name) is None:
                pending.setdefault(module, []).append(("buffer", attr, name))
    return _compute(transformers_model_of(model), pending)


def computed_parameters(model, locations):
    """Names of the modules owning parameters that transformers never saves and computes when loading (the
    model's _keys_to_ignore_on_save: Marian's sinusoidal position embeddings) where the checkpoint lacks them:
    they stay resident, computed first (as compute_buffers does) when on meta. ValueError for one it could not
    compute."""
    root = transformers_model_of(model)
    ignored = set(getattr(root, "_keys_to_ignore_on_save", None) or ()) if root is not None else set()
    if not ignored:
        return []
    owners, pending = [], {}
    for mname, module in model.named_modules():
        for attr, p in module._parameters.items():
            name = f"{mname}.{attr}" if mname else attr
            if p is None or not ignored & set(aliases(name)) or find(locations, name) is not None:
                continue
            owners.append(mname)
            if p.device.type == "meta":
                pending.setdefault(module, []).append(("param", attr, name))
    failed = _compute(root, pending)
    if failed:
        raise ValueError(f"{failed[0]} is on the meta device, and transformers computes it when loading (it never "
                         "saves it), but swapio could not: build the model with its weights")
    return owners


def _compute(root, pending):
    """Fills each pending tensor ({module: [(kind, attribute, name)]}) through root._init_weights(module), as
    transformers' loading does; returns the names of those it left alone (put back on meta)."""
    failed = []
    for module, entries in pending.items():
        if root is None or any(p.device.type != "meta" for p in module.parameters(recurse=False)):
            failed += [name for _, _, name in entries]
            continue
        metas, sentinels = {}, {}
        for kind, attr, name in entries:
            table = module._buffers if kind == "buffer" else module._parameters
            meta = metas[kind, attr] = table[attr]
            value = sentinels[kind, attr] = _sentinel(meta)
            if value is None:
                continue
            real = torch.full(meta.shape, value, dtype=meta.dtype, device="cpu")
            table[attr] = real if kind == "buffer" else torch.nn.Parameter(real, requires_grad=meta.requires_grad)
        with torch.no_grad():
            root._init_weights(module)
        for kind, attr, name in entries:
            table = module._buffers if kind == "buffer" else module._parameters
            value = sentinels[kind, attr]
            if value is None or _still_sentinel(table[attr], value):
                table[attr] = metas[kind, attr]
                failed.append(name)
    return failed


def buffer_owners_outside(model, locations):
    """Names of modules owning a non-persistent buffer that the checkpoint lacks: with offload_buffers=True they
    stay resident, since their buffers can only come from the model (computed, or by compute_buffers)."""
    out = []
    for mname, module in model.named_modules():
        for attr in module._non_persistent_buffers_set:
            name = f"{mname}.{attr}" if mname else attr
            if module._buffers.get(attr) is not None and find(locations, name) is None:
                out.append(mname)
                break
    return out
