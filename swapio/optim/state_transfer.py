"""Moving a whole optimizer state in and out: what state_dict()/load_state_dict() (state_dict_hooks) and
save()/load() (checkpoint) share. Everything here goes through the optimizer's public state-transfer methods
(OffloadOptimizer: param_groups, state, state_format, kept_fields, exported_fields, check_group, read_state,
live_state_tensors, install_state, io_handles), never its private members or its backend.

A source or sink works on pieces: source(p, first, end, {field: view}) fills the stored views of elements
[first, end) of p; sink(p, first, end, {field: view}) reads them. Either may return futures, waited before the
views' buffer is reused. Pieces start on the state format's `align`, so int8 scales line up.
"""
import contextlib
from collections import defaultdict
from copy import deepcopy
from itertools import chain

from ..checkpoint import detached
from .params import FP32, MASTER, shard


def pack_groups(param_groups):
    """(param groups with each parameter replaced by its index, as state_dict() packs them; {id(p): index})."""
    index, packed_groups, start = {}, [], 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        for i, p in enumerate(group["params"], start):
            index.setdefault(id(p), i)
        packed["params"] = [index[id(p)] for p in group["params"]]
        start += len(packed["params"])
        packed_groups.append(packed)
    return packed_groups, index


def remap_groups(param_groups, saved_groups):
    """torch's checks: same number of groups and of parameters per group. Returns (saved index -> parameter, new
    param_groups: the saved groups holding the live parameters)."""
    saved_groups = deepcopy(saved_groups)
    if len(param_groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(param_groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                         "optimizer's group")
    id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                      chain.from_iterable(g["params"] for g in param_groups)))
    new_groups = []
    for g, s in zip(param_groups, saved_groups):
        s["params"] = g["params"]
        if "param_names" in g and "param_names" not in s:
            s["param_names"] = g["param_names"]
        new_groups.append(s)
    return id_map, new_groups


def check_loaded_fields(fmt, p, kept, have):
    """ValueError unless `have` holds every field in `kept` (the rule's fields for p) but the master, which can be
    taken from the parameter, and int8 scales, which come with their moments."""
    missing = [f for f in kept if f != MASTER and not fmt.is_scale(f) and f not in have]
    if missing:
        raise ValueError(f"the loaded state of a parameter of shape {tuple(shard(p).shape)} lacks {missing}")


# An offloaded weight's live master, written in place by swapio.checkpoint.load(out=), would change what the
# optimizer steps from but not the weights the model computes with (load_state_dict() rewrites those)
_OFFLOADED_MASTER = ("the live fp32 master of a weight offloaded by swapio.offload: loading into it would change the "
                     "master but not the weights the model computes with. Load without out= and give the "
                     "optimizer's part to opt.load_state_dict() (which rewrites the offloaded weights too), or use "
                     "opt.save() / opt.load()")


def exported_tensors(opt, params):
    """{p: {field: tensor}} of the exported fields of each parameter: the live tensors where they are stored as
    exported (fp32 state in RAM, as torch's state_dict() gives), else new fp32 tensors decoded from the stored
    state (the whole of it in RAM: save() streams instead); shaped like p, int8 scales flat."""
    live = opt.live_state_tensors(params)
    if live is not None:
        for p, tensors in live.items():
            if MASTER in tensors and opt.is_offloaded(p):
                detached.mark(tensors[MASTER], _OFFLOADED_MASTER)
        return live
    fmt, exported = opt.state_format, opt.exported_fields()
    out = {p: {name: fmt.empty(name, p, FP32) for name in exported[p]} for p in params}
    copied = (f"a copy that {type(opt).__name__}.state_dict() made of its state, which it keeps "
              f"{'in a swap file' if opt.offload == 'nvme' else 'as ' + fmt.name}: loading into it would not "
              "reach the optimizer (its live step counts would change, its moments not). Load without out= and "
              "give the optimizer's part to opt.load_state_dict(), or use opt.save() / opt.load()")
    for tensors in out.values():
        for t in tensors.values():
            detached.mark(t, copied)  # swapio.checkpoint.load(out=) refuses it

    def sink(p, a, b, views):
        for name, t in out[p].items():
            fmt.part(name, t.view(-1), a, b).copy_(fmt.decode(views, name))

    opt.read_state(params, sink)
    return out


def install(opt, new_groups, steps, fields, source, extra_state=None, check=None):
    """Replaces the optimizer's groups and state, all or nothing. steps: {p: fp32 step tensor}; fields: {p: set
    of exported fields the source has}; source(p, first, end, {field: view}) fills the stored views of a piece
    of p but the master when the source has none (taken from the parameter here); extra_state: entries not
    keyed by a parameter, kept as they are; check(): raises if what was read must not be used (checksums). On
    any failure the optimizer keeps its groups and state as they were."""
    for g in new_groups:
        opt.check_group(g)  # e.g. amsgrad groups into an int8 optimizer
    kept = {p: opt.kept_fields(p, g) for g in new_groups for p in g["params"]}
    for p, have in fields.items():
        check_loaded_fields(opt.state_format, p, kept[p], have)
    # entries of the kind the backend gives (nvme mode: nvme_state.StepOnly)
    state = defaultdict(getattr(opt.state, "default_factory", None) or dict)
    for p, step in steps.items():
        state[p]["step"] = step
    for k, v in (extra_state or {}).items():
        state[k] = v

    def filled(p, a, b, views):
        if MASTER in views and MASTER not in fields[p]:
            views = dict(views)
            views.pop(MASTER).copy_(opt.param_value(p).reshape(-1)[a:b])
        return source(p, a, b, views)

    opt.install_state(new_groups, state, {p: kept[p] for p in steps}, filled, list(kept.items()),
                      check or (lambda: None))


@contextlib.contextmanager
def io_handles(opt):
    """(read handle, write handle) for a checkpoint: the swap file's own in nvme mode, new ones (closed on exit)
    in cpu mode."""
    rh, wh, owned = opt.io_handles()
    try:
        yield rh, wh
    finally:
        if owned:
            rh.close()
            if wh is not rh:
                wh.close()
