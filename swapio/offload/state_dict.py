"""cpu_offload(state_dict=...) (accelerate's argument): the weights to offload, given instead of the model's own.

The model may be on meta. Every model tensor the dict holds (under any of its names, peft's and torch.compile's
included: wrappers.py) is replaced by the dict's tensor before offloading, as load_state_dict(assign=True)
would; a tied tensor gets the value of whichever of its names the dict has, and stays tied. Keys that name no
tensor of the model, and shapes or dtypes that differ from the model's, are ValueErrors: a silently ignored key
would leave the model's own (or meta) weights in place.
"""
from collections.abc import Mapping

import torch

from .names import aliases
from .wrappers import keys_as_model_names


def _tensors(model):
    """[(module, table kind, attribute, qualified name, tensor)] of every parameter and buffer, tied ones repeated."""
    out = []
    for mname, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, t in table.items():
                if t is not None:
                    out.append((module, kind, attr, f"{mname}.{attr}" if mname else attr, t))
    return out


def assign_state_dict(model, state_dict):
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    state_dict = keys_as_model_names(model, state_dict)  # a compiled model, the plain one's dict
    entries = _tensors(model)
    value_of, used = {}, set()  # id(model tensor) -> the dict's tensor; keys that found a tensor
    for _, _, _, name, t in entries:
        for a in aliases(name):
            if a in state_dict:
                used.add(a)
                value_of.setdefault(id(t), (a, state_dict[a]))
    unexpected = [k for k in state_dict if k not in used]
    if unexpected:
        raise ValueError(f"state_dict has {len(unexpected)} key(s) that name no parameter or buffer of the model, "
                         f"such as {unexpected[:3]}")
    new_of = {}
    for module, kind, attr, name, t in entries:
        if id(t) not in value_of:
            continue
        if id(t) not in new_of:
            key, value = value_of[id(t)]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}, not a tensor")
            if tuple(value.shape) != tuple(t.shape) or value.dtype != t.dtype:
                raise ValueError(f"state_dict[{key!r}] is {value.dtype} {list(value.shape)}, the model's {name} is "
                                 f"{t.dtype} {list(t.shape)}")
            value = value.detach()
            new_of[id(t)] = torch.nn.Parameter(value, requires_grad=t.requires_grad) if kind == "param" else value
        (module._parameters if kind == "param" else module._buffers)[attr] = new_of[id(t)]
