"""torch.compile's wrapper module, and the names a compiled model's tensors have in the plain model's checkpoint.

torch.compile(model) returns an OptimizedModule holding the model as its `_orig_mod` submodule: every tensor
name gains that segment (`_orig_mod.0.weight`, `layers.0._orig_mod.weight` for a compiled submodule), while the
checkpoint, saved from the plain model (save_pretrained and accelerate's save_model unwrap it), says `0.weight`.
accelerate's load_checkpoint_in_model reaches through it (the wrapper forwards attribute lookups), so swapio
looks a compiled model's tensor up under its unwrapped name too, and saves the unwrapped names. The wrapper is
recognised by its type, not by the name. (DistributedDataParallel and DataParallel over offloaded weights are
refused instead: data_parallel.py.)
"""
from .compiled import is_compile_wrapper
from .names import aliases


def wrapped_attribute(module):
    """The attribute under which `module` holds the model it wraps (`_orig_mod`), or None."""
    return "_orig_mod" if is_compile_wrapper(module) else None


def unwrap(model):
    """The model inside torch.compile's wrappers around `model` (model itself when it is none)."""
    attr = wrapped_attribute(model)
    while attr is not None:
        model = model._modules[attr]
        attr = wrapped_attribute(model)
    return model


def unwrapped_names(model):
    """{name: the name without torch.compile's wrapper segments} of every parameter and buffer of `model` (tied
    ones under each of their names) whose name has such a segment."""
    out = {}
    stack = [(model, "", "")]
    while stack:
        module, outer, inner = stack.pop()
        if outer != inner:
            for table in (module._parameters, module._buffers):
                out.update((outer + attr, inner + attr) for attr, t in table.items() if t is not None)
        skip = wrapped_attribute(module)
        for cname, child in module._modules.items():
            if child is not None:
                stack.append((child, f"{outer}{cname}.", inner if cname == skip else f"{inner}{cname}."))
    return out


def under_model_names(model, locations):
    """`locations` ({checkpoint name: value}) with each wrapped tensor of `model` also under its own name, found
    under its unwrapped name (or that name's peft aliases); `locations` itself when the model has no wrapper."""
    renamed = unwrapped_names(model)
    if not renamed:
        return locations
    out = dict(locations)
    for name, inner in renamed.items():
        if name in out:
            continue
        for alias in aliases(inner):
            if alias in locations:
                out[name] = locations[alias]
                break
    return out


def keys_as_model_names(model, state_dict):
    """A state_dict of the plain model with its keys as `model` (wrapped) names the tensors: each key that is a
    wrapped tensor's unwrapped name (or a peft alias of it) and no tensor's own name is renamed; others are kept
    (assign_state_dict reports those naming no tensor, and a tensor given under both names). `state_dict` itself
    when the model has no wrapper."""
    renamed = unwrapped_names(model)
    if not renamed:
        return state_dict
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    own |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    wrapped_name = {}
    for name, inner in renamed.items():
        for alias in aliases(inner):
            wrapped_name.setdefault(alias, name)
    out = {}
    for key, value in state_dict.items():
        new = key if key in own else wrapped_name.get(key, key)
        if new != key and new in state_dict:  # given under both names: kept apart, assign_state_dict says so
            new = key
        out[new] = value
    return out
