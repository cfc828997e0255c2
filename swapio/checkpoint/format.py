"""How swapio.checkpoint stores a training state in a safetensors file, both ways: the state's tensors under their
path names (structure.py), everything else as JSON in the header's __metadata__ under `format`, `format_version`
and `structure`, laid out by swapio.safetensors.layout.plan. A file without that mark (any other safetensors file,
a save_pretrained directory) loads as {name: tensor} in file order.
"""
import json

from ..safetensors import layout
from ..safetensors.header import json_depth
from .structure import MAX_NESTING, MAX_STRUCTURE_DEPTH, flatten, tensor_nodes

FORMAT, VERSION = "swapio.checkpoint", "1"
META_FORMAT, META_VERSION, META_STRUCTURE = "format", "format_version", "structure"


def plan_state(state, metadata=None, placeholders=False):
    """The layout.Plan of the file holding `state` (every tensor's offset, the header): TypeError for what cannot
    be stored, before any file exists. metadata: more {str: str} for the header's __metadata__. placeholders: meta
    tensors stand for bytes the caller streams itself (FileWriter.write's stream)."""
    skeleton, entries = flatten(state, placeholders)
    for e in entries:  # a lazily conjugated or negated view: its values, one copy of it (its memory holds others)
        if e.tensor.is_conj() or e.tensor.is_neg():
            e.tensor = e.tensor.resolve_conj().resolve_neg()
    return layout.plan(entries, _metadata(skeleton, metadata))


def _metadata(skeleton, extra):
    metadata = dict(extra or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must be a dict of str to str (safetensors' __metadata__)")
    reserved = sorted(set(metadata) & {META_FORMAT, META_VERSION, META_STRUCTURE})
    if reserved:
        raise ValueError(f"metadata key {reserved[0]!r} is reserved: swapio.checkpoint writes "
                         f"{META_FORMAT!r}, {META_VERSION!r} and {META_STRUCTURE!r} itself; use another key")
    metadata.update({META_FORMAT: FORMAT, META_VERSION: VERSION,
                     META_STRUCTURE: json.dumps(skeleton, separators=(",", ":"))})
    return metadata


def skeleton_of(opened):
    """(the saved structure, the file named in errors) of an opened checkpoint (swapio.safetensors.open_checkpoint):
    the skeleton swapio wrote, checked, else {name: tensor} in file order."""
    where, metadata = opened.files[0], opened.metadata
    if metadata.get(META_FORMAT) != FORMAT:
        return {"D": [[name, {"T": name}] for name in sorted(opened, key=lambda n: opened[n].offset)]}, where
    try:
        if int(metadata.get(META_VERSION, "0")) > int(VERSION):
            raise ValueError(f"{where}: checkpoint format version {metadata[META_VERSION]}; this swapio reads up to "
                             f"{VERSION}")
        text = metadata[META_STRUCTURE]
        if json_depth(text) > MAX_STRUCTURE_DEPTH:  # json.loads would recurse that deep (RecursionError)
            raise ValueError(f"nests deeper than {MAX_STRUCTURE_DEPTH} levels; save allows {MAX_NESTING}")
        skeleton = json.loads(text)
        tensor_nodes(skeleton)
    except (KeyError, TypeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{where}: the checkpoint's structure in __metadata__ is malformed ({exc})") from None
    return skeleton, where
