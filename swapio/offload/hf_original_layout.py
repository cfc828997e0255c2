"""save_pretrained's save_original_format for an offloaded transformers model: the tensors transformers' own
save_pretrained would write, under its names, with its bytes.

transformers 5 converts some checkpoints as it loads them (hf_checkpoint_names.py), and its save_pretrained
undoes that (revert_weight_conversion): GPT-NeoX's `lm_head` is written back as `embed_out` (a rename), and
Mixtral's fused `experts.gate_up_proj` [experts, 2 * ffn, hidden] as each expert's `w1` and `w3` (a split). The
plan is made by transformers' own function on meta tensors, so that it follows its rules for every architecture:
for each stored tensor alone (what it becomes) and for all of them together (what transformers writes). A
tensor it passes through unchanged keeps its bytes, under its saved name; one it computes from is written as
parts, each computed from the tensor's value when its bytes are asked (one offloaded record at a time). A saved
tensor made from several of the model's tensors together (one a model splits when loading, such as a fused
qkv) would need them all at once: that, and a conversion transformers cannot revert, is a ValueError that
says what to do, never a checkpoint other than transformers'.
"""
import torch

from ..safetensors.layout import Entry
from .export_tensors import Item, Split
from .hf_model import is_transformers_model

_WAY_OUT = ("Save with save_original_format=False (the model's own layout, which transformers' from_pretrained "
            "loads as well), or remove_offload(model) first and save with transformers")


def _revert_function():
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5: it converts nothing
        return None
    return revert_weight_conversion


def _revert(revert, model, tensors, what):
    try:
        return revert(model, dict(tensors))
    except Exception as exc:  # noqa: BLE001 - transformers' own failure, named and chained
        raise ValueError(f"save_pretrained: transformers cannot convert {what} back to the "
                         f"{model.config.model_type} checkpoint layout it writes ({type(exc).__name__}: {exc}). "
                         f"{_WAY_OUT}") from exc


def _shown(names):
    names = sorted(names)
    return ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")


def original_layout(model, stored):
    """The Items save_pretrained(save_original_format=True) of `model` stores, from save_checkpoint's `stored`
    (see the module). `stored` itself when transformers converts nothing."""
    revert = _revert_function()
    if revert is None or not is_transformers_model(model):
        return stored
    metas = {it.entry.name: torch.empty(it.entry.tensor.shape, dtype=it.entry.tensor.dtype, device="meta")
             for it in stored}
    whole = _revert(revert, model, metas, "the model's tensors")
    out, made_from = [], {}
    for it in stored:
        name = it.entry.name
        try:
            mine = revert(model, {name: metas[name]})
        except Exception as exc:  # noqa: BLE001 - it converts back only with others (the whole went through)
            raise _together(model, f"converts the model's tensor {name!r} back only together with others") from exc
        for saved in mine:
            made_from.setdefault(saved, []).append(name)
        if len(mine) == 1 and next(iter(mine.values())) is metas[name]:  # passed through: the same bytes
            it.entry.name = next(iter(mine))
            out.append(it)
            continue
        entries = {saved: Entry(saved, t, saved) for saved, t in mine.items()}
        split = Split(lambda value, name=name: revert(model, {name: value}), entries)
        out.extend(Item(e, it.slot, it.tensor, (split, saved)) for saved, e in entries.items())
    together = {saved: sources for saved, sources in made_from.items() if len(sources) > 1}
    planned = {it.entry.name: (tuple(it.entry.tensor.shape), it.entry.tensor.dtype) for it in out}
    wanted = {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}
    if together or planned != wanted:
        saved = next(iter(together)) if together else next(n for n in {**wanted, **planned}
                                                            if wanted.get(n) != planned.get(n))
        raise _together(model, f"writes {saved!r} from several of the model's tensors at once"
                        + (f" ({_shown(together[saved])})" if together else ""))
    return out


def _together(model, what):
    return ValueError(f"save_pretrained of this {model.config.model_type} model: transformers {what}, which swapio, "
                      f"streaming one offloaded tensor at a time, does not compute. {_WAY_OUT}")
