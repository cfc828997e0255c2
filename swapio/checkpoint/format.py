"""How swapio.checkpoint stores a training state in a safetensors file, both ways: the state's tensors under their
path names (structure.py), everything else as JSON in the header's __metadata__ under `format`, `format_version`
and `structure`, laid out by swapio.safetensors.layout.plan. A file without that mark (any other safetensors file,
a save_pretrained directory) loads as {name: tensor} in file order.
"""
import json
from collections.abc import Mapping

from ..safetensors import layout
from ..safetensors.header import json_depth
from .structure import MAX_NESTING, MAX_STRUCTURE_DEPTH, flatten, tensor_nodes

FORMAT, VERSION = "swapio.checkpoint", "2"
# Version 2 added these skeleton keys (structure.py). A file that uses none of them is written as version 1, so an
# earlier swapio still reads it; one that does is version 2, which an earlier swapio refuses with a clear message
# (it read "p", "g", "m" and "c" and dropped them: a Parameter loaded as a plain tensor, a Counter as a dict).
_KEYS_SINCE_V2 = frozenset(("S", "R", "i", "p", "g", "m", "c"))
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


def check_metadata_type(extra):
    """TypeError unless metadata= is None or a mapping (dict() of a str raised "update sequence element")."""
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"metadata must be a dict of str to str (safetensors' __metadata__), got "
                        f"{type(extra).__name__}")


def _metadata(skeleton, extra):
    check_metadata_type(extra)
    metadata = dict(extra or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must be a dict of str to str (safetensors' __metadata__)")
    reserved = sorted(set(metadata) & {META_FORMAT, META_VERSION, META_STRUCTURE})
    if reserved:
        raise ValueError(f"metadata key {reserved[0]!r} is reserved: swapio.checkpoint writes "
                         f"{META_FORMAT!r}, {META_VERSION!r} and {META_STRUCTURE!r} itself; use another key")
    metadata.update({META_FORMAT: FORMAT, META_VERSION: _version_needed(skeleton),
                     META_STRUCTURE: json.dumps(skeleton, separators=(",", ":"))})
    return metadata


def _version_needed(skeleton):
    """The oldest format version that reads `skeleton` as saved: "1" unless it uses a node added since."""
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if not _KEYS_SINCE_V2.isdisjoint(node):
                return VERSION
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return "1"


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
