"""A training state (nested dicts, lists, tuples of tensors and plain values) <-> flat named tensors plus a
JSON skeleton of everything else.

Tensor names are the paths to them, joined by "." (`model.layer.weight`, `optimizer.state.0.exp_avg`); a path
that another one already took (the dict key "a.b" next to a nested a -> b, or the int key 0 next to the str "0")
gets a "#n" suffix. The skeleton keeps the exact structure, so names are labels for other readers, never parsed.
Skeleton nodes: {"T": name} a tensor (+ "dtype" when stored as raw bytes, + "stride" when it was dense but not
contiguous, + "p": 1 for an nn.Parameter, + "g": 1 when it requires grad), {"D": [[key, node], ...]} a dict
("o": 1 for an OrderedDict, + "m": its _metadata if it has one, a
state_dict()'s module versions; "c": 1 for a Counter), {"L": [...]} a list, {"U": [...]} a tuple, {"S": [ints]} a torch.Size, {"V": value}
an int, float, bool, str or None, {"R": i} the dict or list marked "i": i earlier in the walk (reached again: it
loads as one object at both places, as torch.load keeps it). Dict keys may be str, int, float, bool or None.

Types are exact: torch.load gives back a subclass (a defaultdict, an OrderedDict subclass such as transformers'
ModelOutput, an IntEnum, a tensor subclass) as itself, so one stored as its base type would come back silently
different: a TypeError naming it instead (nn.Parameter and torch.Size are kept). The structure given as load's
out= only names tensors, so there any container and tensor type is taken as its base (lenient=True).

Shared storage: the same view (same memory, dtype, shape and strides) reached twice, as tied weights are, is
stored once and loads as one tensor at both places. Other tensors sharing memory (overlapping slices) are stored
each on its own and load as independent tensors.
"""
import collections
import sys

import torch

from ..safetensors.dtypes import dtype_name
from ..safetensors.layout import Entry

_PLAIN = (int, float, bool, str, type(None))
MAX_NESTING = 100  # dicts/lists/tuples within each other; deeper (or a cycle) is a TypeError
MAX_STRUCTURE_DEPTH = 3 * MAX_NESTING + 8  # JSON brackets of the skeleton of such a state (load refuses deeper)
_KEYS = (str, int, float, bool, type(None))


def _describe(path):
    return "state" + "".join(f"[{k!r}]" for k in path)


def _identity(t):
    """Equal for the same view of the same memory, as the same kind of tensor (a Parameter and its .detach() are
    two tensors to torch.load, stored apart)."""
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), t.is_conj(), t.is_neg(), type(t),
            t.requires_grad) if t.numel() else None


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (dict, collections.OrderedDict, collections.Counter, list, tuple)  # (MultiStepLR's milestones: a Counter)
_JSON_INT_BITS = 3 * 4000  # ints shorter than this always fit sys.get_int_max_str_digits()'s default (4300)


def _plain_fits(x, what):
    """ValueError naming `what` for an int json.dumps would refuse (longer than the interpreter's digit limit)."""
    # (the limit exists from Python 3.11 and the security releases of 3.9 and 3.10 on; 0 means none)
    if type(x) is int and x.bit_length() > _JSON_INT_BITS and getattr(sys, "get_int_max_str_digits", int)():
        try:
            str(x)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None


def _module_metadata(metadata, path):
    """A state_dict()'s `_metadata` ({module prefix: {"version": int, ...}}, which load_state_dict hands each
    module's _load_from_state_dict: a module finding none takes the state for an old version's) as JSON."""
    plain = isinstance(metadata, dict) and all(
        type(k) is str and isinstance(v, dict) and all(type(a) is str and type(b) in _PLAIN for a, b in v.items())
        for k, v in metadata.items())
    if not plain:
        raise TypeError(f"{_describe(path)}: its _metadata (a state_dict()'s module versions) holds other values "
                        "than {str: {str: int, float, bool, str or None}}, which cannot be stored")
    return {k: dict(v) for k, v in metadata.items()}


def _metadata_ok(m):
    return isinstance(m, dict) and all(isinstance(v, dict) and all(isinstance(b, _PLAIN) for b in v.values())
                                       for v in m.values())


def _not_exact(x, path):
    return TypeError(f"{_describe(path)}: a {type(x).__name__} (a subclass of {type(x).__mro__[1].__name__}) "
                     "cannot be stored: it would load as its base type; convert it first (dict(x), list(x), ...)")


def dense(shape, stride):
    """True when these strides place the shape's elements each at its own place, without gaps, in some order
    (row-major, a transpose, channels_last): the memory holds exactly the elements."""
    dims = sorted((s, n) for s, n in zip(stride, shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def _dense_permuted(t):
    """True when t covers its elements without gaps in another order than row-major (a transpose,
    channels_last): load gives back those strides."""
    return not t.is_contiguous() and t.numel() > 1 and dense(t.shape, t.stride())


def flatten(state, placeholders=False, lenient=False):
    """(skeleton, [Entry]) of a state; TypeError naming the key of anything that cannot be stored.
    placeholders=True: meta tensors are taken as stand-ins for bytes the caller streams into the file itself
    (swapio.optim.checkpoint), each stored on its own. lenient=True (load's out=): subclasses of containers and
    tensors are walked as their base types, and a meta tensor is a ValueError (no memory to load into)."""
    entries, taken, seen = [], set(), {}

    def name_for(path):
        base = ".".join(str(k) for k in path) or "tensor"
        name, n = base, 1
        while name in taken or name == "__metadata__":
            name, n = f"{base}#{n}", n + 1
        taken.add(name)
        return name

    on_path = set()  # ids of the containers being walked: one met again is a cycle
    walked = {}  # id of a dict or list walked whole -> its node: met again, it is stored as a reference to it
    marks = [0]  # the next "i"

    def walk(x, path):
        if isinstance(x, (dict, list, tuple)) and not isinstance(x, torch.Tensor):
            if id(x) in on_path:
                raise TypeError(f"{_describe(path)}: the state contains itself (a reference cycle) and cannot be "
                                "stored")
            node = walked.get(id(x))
            if node is not None:  # (the state holds x, so its id is not reused meanwhile)
                if "i" not in node:
                    node["i"], marks[0] = marks[0], marks[0] + 1
                return {"R": node["i"]}
            if len(path) >= MAX_NESTING:
                raise TypeError(f"{_describe(path[:5])}...: the state nests deeper than {MAX_NESTING} levels of "
                                "dicts, lists and tuples")
            on_path.add(id(x))
            try:
                node = walk_container(x, path)
            finally:
                on_path.discard(id(x))
            if isinstance(x, (dict, list)):  # (tuples are immutable: a copy is the same to the user)
                walked[id(x)] = node
            return node
        return walk_leaf(x, path)

    def walk_leaf(x, path):
        if isinstance(x, torch.Tensor):
            if x.is_nested:
                raise TypeError(f"{_describe(path)}: a nested tensor (torch.nested) cannot be stored (store its "
                                "components, x.unbind(), instead)")
            if x.layout != torch.strided:
                raise TypeError(f"{_describe(path)}: a {x.layout} tensor cannot be stored (call .to_dense())")
            if not lenient and type(x) not in _TENSOR_TYPES:
                raise TypeError(f"{_describe(path)}: a {type(x).__name__} (a torch.Tensor subclass) cannot be "
                                "stored: it would load as a plain tensor; store plain tensors instead (for a "
                                "DTensor: x.full_tensor(), or x.to_local() on each rank with save(..., "
                                "distributed=True))")
            meta = x.device.type == "meta"
            if meta and lenient:
                raise ValueError(f"out= tensor {_describe(path)} is on the meta device: it has no memory to load "
                                 "into (materialize it first, e.g. model.to_empty(device='cpu'))")
            if meta and not placeholders:
                raise TypeError(f"{_describe(path)}: a tensor on the meta device has no data to store")
            ident = None if meta else _identity(x)  # (meta tensors all have address 0: never "shared")
            if ident is not None and ident in seen:
                return dict(seen[ident])
            entry = Entry(name_for(path), x, _describe(path))
            entries.append(entry)
            node = {"T": entry.name}
            if entry.raw:
                node["dtype"] = dtype_name(x.dtype)
            if _dense_permuted(x):
                node["stride"] = list(x.stride())
            if type(x) is torch.nn.Parameter:
                node["p"] = 1
            if x.requires_grad:  # (a non-leaf too: torch.load gives it as a leaf requiring grad)
                node["g"] = 1
            if ident is not None:
                seen[ident] = node
            return node
        if isinstance(x, _PLAIN) and type(x) in _PLAIN:  # not a subclass (an IntEnum would come back an int)
            _plain_fits(x, _describe(path))
            return {"V": x}
        raise TypeError(f"{_describe(path)}: a {type(x).__name__} cannot be stored in a checkpoint (tensors, "
                        "dicts, lists, tuples, int, float, bool, str and None can)")

    def walk_container(x, path):
        if type(x) is torch.Size:
            return {"S": list(x)}
        if not lenient and type(x) not in _CONTAINERS and not hasattr(x, "_fields"):
            raise _not_exact(x, path)
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                # (an IntEnum or str subclass key would come back as its base type)
                if not isinstance(k, _KEYS) or (not lenient and type(k) not in _KEYS):
                    raise TypeError(f"{_describe(path)}: dict key {k!r} is a {type(k).__name__}; keys may be str, "
                                    "int, float, bool or None")
                _plain_fits(k, f"{_describe(path)}: dict key")
                items.append([k, walk(v, path + (k,))])
            node = {"D": items}
            if isinstance(x, collections.OrderedDict):
                node["o"] = 1
                metadata = getattr(x, "_metadata", None)  # module.state_dict()'s versions, as torch.save keeps them
                if metadata is not None:
                    node["m"] = _module_metadata(metadata, path)
            elif type(x) is collections.Counter:
                node["c"] = 1
            return node
        if isinstance(x, list):
            return {"L": [walk(v, path + (i,)) for i, v in enumerate(x)]}
        if isinstance(x, tuple) and not hasattr(x, "_fields"):  # a namedtuple would come back as a tuple
            return {"U": [walk(v, path + (i,)) for i, v in enumerate(x)]}
        if isinstance(x, _PLAIN) and type(x) in _PLAIN:  # not a subclass (an IntEnum would come back an int)
            return {"V": x}
        raise TypeError(f"{_describe(path)}: a {type(x).__name__} cannot be stored in a checkpoint (tensors, "
                        "dicts, lists, tuples, int, float, bool, str and None can)")

    try:
        return walk(state, ()), entries
    finally:  # the nested functions refer to each other: a cycle holding the tensors until the collector runs
        walk = walk_leaf = walk_container = None  # noqa: F841 (the cells are what is cleared)


def tensor_nodes(skeleton):
    """The {"T": ...} nodes of a skeleton, in order (shared tensors once per place). The skeleton comes from a
    file: every node is checked to be what flatten writes (ValueError otherwise), so unflatten cannot fail on it."""
    stack, out, marked, done = [skeleton], [], set(), set()
    while stack:
        node = stack.pop()
        if isinstance(node, int):  # the end of the container marked `node`: references to it may follow
            done.add(node)
            continue
        if not isinstance(node, dict) or len(node) == 0:
            raise ValueError(f"malformed skeleton node {node!r}")
        if "m" in node and not ("D" in node and node.get("o") and _metadata_ok(node["m"])):
            raise ValueError(f"malformed skeleton node {_short(node)}: 'm' must be an OrderedDict's module metadata")
        if "i" in node:
            if type(node["i"]) is not int or node["i"] in marked or not ("D" in node or "L" in node):
                raise ValueError(f"malformed skeleton node {_short(node)}: 'i' must mark one dict or list")
            marked.add(node["i"])
            stack.append(node["i"])
        if "T" in node:
            out.append(node)
        elif "D" in node:
            items = node["D"]
            if not isinstance(items, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
                raise ValueError(f"malformed skeleton node {_short(node)}: 'D' must be a list of [key, node]")
            for k, _ in items:
                if not isinstance(k, _KEYS):
                    raise ValueError(f"malformed skeleton node {_short(node)}: a dict key may be str, int, float, "
                                     f"bool or None, not {type(k).__name__}")
            stack.extend(v for _, v in reversed(items))
        elif "R" in node:
            if type(node["R"]) is not int or node["R"] not in done:
                raise ValueError(f"malformed skeleton node {_short(node)}: 'R' must refer to a dict or list "
                                 "stored whole before it")
        elif "S" in node:
            if not isinstance(node["S"], list) or not all(type(n) is int and -(1 << 63) <= n < 1 << 63
                                                          for n in node["S"]):
                raise ValueError(f"malformed skeleton node {_short(node)}: 'S' must be a list of int64 sizes")
        elif "L" in node or "U" in node:
            items = node.get("L", node.get("U"))
            if not isinstance(items, list):
                raise ValueError(f"malformed skeleton node {_short(node)}: 'L' and 'U' must be lists")
            stack.extend(reversed(items))
        elif "V" not in node or not isinstance(node["V"], _PLAIN):
            raise ValueError(f"malformed skeleton node {_short(node)}")
    return out


def tensor_paths(skeleton):
    """{name: path} of a skeleton's tensors: the keys and indices leading to each (its first place when shared)."""
    paths, stack = {}, [(skeleton, ())]
    while stack:
        node, path = stack.pop()
        if "T" in node:
            paths.setdefault(node["T"], path)
        elif "D" in node:
            stack.extend((v, path + (k,)) for k, v in reversed(node["D"]))
        elif "L" in node or "U" in node:
            stack.extend((v, path + (i,)) for i, v in reversed(list(enumerate(node.get("L", node.get("U"))))))
    return paths


def renamed(names):
    """The names of `names` that flatten made unique ("a.b" and "a.b#1": the dict key "a.b" next to a nested
    a -> b, the int key 0 next to the str "0"), the first one included: which place got which depends on the
    order the places were walked in."""
    out = set()
    for name in names:
        base, sep, n = name.rpartition("#")
        if sep and n.isdigit() and base in names:
            out.update((name, base))
    return out


def _short(node):
    text = repr(node)
    return text if len(text) <= 120 else text[:117] + "..."


def unflatten(skeleton, tensors, marked=None):
    """The state a skeleton describes, with tensors[name] at each tensor's place. (A module-level recursion: a
    nested one is a reference cycle, which would keep the tensors alive until the cycle collector runs.)
    marked: {i: the container marked "i"} built so far, for the references to it."""
    marked = {} if marked is None else marked
    if "T" in skeleton:
        return tensors[skeleton["T"]]
    if "R" in skeleton:
        return marked[skeleton["R"]]
    if "D" in skeleton:
        built = dict((k, unflatten(v, tensors, marked)) for k, v in skeleton["D"])
        if skeleton.get("o"):
            built = collections.OrderedDict(built)
            if "m" in skeleton:
                built._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
                    (k, dict(v)) for k, v in skeleton["m"].items())
        elif skeleton.get("c"):
            built = collections.Counter(built)  # (from a dict: Counter(pairs) would count the pairs)
    elif "L" in skeleton:
        built = [unflatten(v, tensors, marked) for v in skeleton["L"]]
    else:
        built = None
    if built is not None:
        if "i" in skeleton:
            marked[skeleton["i"]] = built
        return built
    if "U" in skeleton:
        return tuple(unflatten(v, tensors, marked) for v in skeleton["U"])
    if "S" in skeleton:
        return torch.Size(skeleton["S"])
    return skeleton["V"]
