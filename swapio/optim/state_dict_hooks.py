"""torch's Optimizer.state_dict() / load_state_dict() for the offloaded optimizers, through torch's public hooks.

state_dict: torch packs the param groups and optimizer.state, which holds only "step" in nvme mode and the live
tensors (the master of fp32 parameters included) in cpu mode. A post-hook, run before any other, makes each
parameter's entry "step" plus the fields the rule exports, read from the state backend.

load_state_dict: torch casts every state tensor with Optimizer._process_value_according_to_param_policy, called
on the base class by name, so an override is never reached: a bf16 parameter would round its fp32 moments to
bf16, and a GPU parameter would pull its whole state onto the GPU. So a pre-hook, run after every other (the user's see and
may edit the whole state dict, as with torch), takes the parameters' entries out of the state dict, casts them
with the optimizer's own policy (fp32 CPU copies) and checks them; torch then checks and installs the param
groups; a post-hook, run before any other, hands the taken state to the backend, stored as the optimizer's state format says (an fp32
state dict loaded into an int8 optimizer is quantised).
"""
from itertools import chain

import torch

from . import state_transfer, unstepped_weights, validate
from .checkpoint import files as checkpoint_files
from .params import shard
from .state_format import SCALE

_TAKEN = "_swapio_loaded_state"  # optimizer attribute: the state between the pre- and the post-hook
_OURS = "_swapio_state_dict_hooks"  # optimizer attribute: {torch's hook dict attribute: (our hook's id, first)}


def register(opt):
    """Registers the three hooks, to be kept in place (keep_in_place) whatever the user registers later."""
    setattr(opt, _OURS, {
        "_optimizer_state_dict_post_hooks": (opt.register_state_dict_post_hook(_export_state).id, True),
        "_optimizer_load_state_dict_pre_hooks": (opt.register_load_state_dict_pre_hook(_take_state).id, False),
        "_optimizer_load_state_dict_post_hooks": (opt.register_load_state_dict_post_hook(_install_state).id, True),
    })
    keep_in_place(opt)


def keep_in_place(opt):
    """Puts our hooks back where they must run, after the user registered one: the export first among state-dict
    post-hooks and the install first among load post-hooks (a user's, even given prepend=True, sees the state
    filled in or installed), the taking of the state last among load pre-hooks (a user's sees, and may edit, the
    whole state dict, as with torch)."""
    for attribute, (hook_id, first) in opt.__dict__.get(_OURS, {}).items():
        hooks = getattr(opt, attribute)
        if hook_id in hooks:
            hooks.move_to_end(hook_id, last=not first)


def _export_state(opt, state_dict):
    index = state_transfer.pack_groups(opt.param_groups)[1]
    packed = state_dict["state"]
    params = [p for p, st in opt.state.items() if isinstance(p, torch.Tensor)]
    stateful = [p for p in params if opt.state[p]]
    tensors = state_transfer.exported_tensors(opt, stateful)
    for p in params:
        if p in tensors:
            packed[index[id(p)]] = {"step": opt.state[p]["step"], **tensors[p]}
        else:  # an empty entry (torch packs those too)
            del packed[index[id(p)]]
    unstepped = unstepped_weights.checksums(opt, index, {index[id(p)] for p in tensors})
    if unstepped:  # (absent otherwise: such state dicts are as before)
        state_dict[unstepped_weights.STATE_DICT_KEY] = {k: f"{c:016x}" for k, c in unstepped.items()}


def _take_state(opt, state_dict):
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in state_dict["param_groups"])):
        raise ValueError("a state dict must be a dict with a dict 'state' and a list 'param_groups' of dicts, each "
                         "with a list 'params'")
    if state_dict.get("format") == checkpoint_files.FORMAT and state_dict.get("state_dtype") == "int8":
        raise ValueError("this state dict is an int8 optimizer checkpoint's arrays as stored (what "
                         "swapio.checkpoint.load reads from swapio-optim.safetensors): its moments are 8-bit codes, "
                         "not values. Load the checkpoint's directory with opt.load(dir)")
    for i, g in enumerate(state_dict["param_groups"]):  # as saved: torch fills missing keys as it installs them
        try:
            opt.check_group(g)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"param group {i}: {exc}") from None
    saved_params = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
    if len(saved_params) != len(params):
        return None  # torch raises its own error about the groups
    id_map = dict(zip(saved_params, params))
    unstepped_weights.check(opt, id_map, unstepped_weights.recorded(state_dict), "the loaded state dict")
    saved_group = {k: g for g in state_dict["param_groups"] for k in g["params"]}
    policy = opt._process_value_according_to_param_policy
    steps, values, rest = {}, {}, {}
    for k, entry in state_dict["state"].items():
        p = id_map.get(k)
        if p is None:
            rest[k] = entry
            continue
        where = f"the loaded state of parameter {k}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a dict, got {type(entry).__name__}")
        if not entry:
            continue
        if "step" not in entry:
            raise ValueError(f"{where} has no 'step'")
        steps[p] = validate.step_count(entry["step"], where)
        values[p] = {}
        for key, val in entry.items():
            if key in opt.state_keys:
                validate.has_values(key, val, where)
                val = policy(p, val, k, state_dict["param_groups"], key)  # a DTensor's local shard, fp32 CPU
                shape = shard(p).shape
                validate.state_tensor(key, val, opt.state_format.shape(key, shape), shape, where)
                values[p][key] = val.reshape(-1)
        state_transfer.check_loaded_fields(opt.state_format, p, opt.kept_fields(p, saved_group[k]), values[p])
    setattr(opt, _TAKEN, (steps, values))
    return {**state_dict, "state": rest}


def _install_state(opt):
    steps, values = opt.__dict__.pop(_TAKEN)

    fmt = opt.state_format

    def source(p, a, b, views):  # fp32 values, stored as the state format says (int8: quantised)
        fields = [name for name in views if not fmt.is_scale(name)]
        scales = {}  # from an int8 optimizer's state_dict: the block scales, for an exact re-import
        for name in fields:
            scale = values[p].get(name + SCALE)
            if scale is not None:
                scales[name] = fmt.part(name + SCALE, scale, a, b)
        fmt.encode_fields(views, {name: fmt.part(name, values[p][name], a, b) for name in fields}, scales)

    extra = {k: v for k, v in opt.state.items() if not isinstance(k, torch.Tensor)}
    state_transfer.install(opt, opt.param_groups, steps, {p: set(v) for p, v in values.items()}, source, extra)


def discard_taken(opt):
    """Drops the state a failed load_state_dict took but did not install."""
    opt.__dict__.pop(_TAKEN, None)

