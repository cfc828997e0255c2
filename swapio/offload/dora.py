"""peft's DoRA (LoraConfig(use_dora=True)) over offloaded base layers.

A DoRA layer reads its base layer's weight in its own forward, outside the base layer's (the weight's norm), and
computes its magnitude vector from that weight when the adapter is created. Between forwards an offloaded weight
is a meta placeholder (or, right after wrapping, a NaN stand-in: grafting.py): the forward failed with torch's
"Tensor on device cpu is not on the expected device meta!", and a DoRA adapter created on an offloaded base got a
NaN magnitude, which a merge wrote into the stored weight. Offloading a DoRA peft model with its LoRA layers'
class in preload_module_classes brings each base weight in for the whole LoRA layer's forward, which works.
"""


def uses_dora(module):
    """Whether `module` is a peft LoRA layer with a DoRA adapter."""
    magnitudes = getattr(module, "lora_magnitude_vector", None)
    return magnitudes is not None and hasattr(magnitudes, "__len__") and len(magnitudes) > 0


def check_offloaded(model, units, preload_names):
    """ValueError for a DoRA layer whose offloaded base layer's weights its forward would not find: neither it nor
    a module around it has its class in preload_module_classes."""
    offloaded = {id(u.module) for u in units}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        base = getattr(module, "base_layer", None)
        if not uses_dora(module) or id(base) not in offloaded:
            continue
        parts = name.split(".") if name else []
        around = [modules[".".join(parts[:i])] for i in range(len(parts) + 1)]
        if not any(type(m).__name__ in preload_names for m in around):
            raise ValueError(f"{name} is a peft DoRA layer (use_dora=True), whose forward reads its base layer's "
                             "weight outside the base layer's forward: pass "
                             f"preload_module_classes=[{type(module).__name__!r}] (its class), so that its base "
                             "weights are brought in for its whole forward, or keep it resident with "
                             f"keep_resident=[{name!r}]")


def created_on_stand_ins(module):
    """The RuntimeError of a DoRA adapter created on an offloaded base (get_peft_model after offloading)."""
    return RuntimeError("peft's DoRA (use_dora=True) was applied to a model offloaded by swapio: it computed the "
                        "adapter's magnitude from the base weight, which swapio held offloaded (its stand-in holds "
                        "NaN), so the adapter is not usable. Apply DoRA to the resident model first, then offload "
                        f"the peft model with preload_module_classes=[{type(module).__name__!r}]")
