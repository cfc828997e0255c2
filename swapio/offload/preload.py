"""preload_module_classes (accelerate's argument): modules of these classes get all their submodules' weights at
the start of their own forward, for modules that use a submodule's weight directly rather than calling it.

Each such module's pre-forward hook enters every unit under it (fetching their records and installing their
weights, as the units' own hooks do), and its post-forward hook, which also runs when the forward raises, leaves
them in reverse order. The units' own hooks then find their weights in place: the engine counts nested entries
(unit.depth), so they neither fetch again nor release early.
"""


def _class_names(preload_module_classes):
    if preload_module_classes is None:
        return set()
    if isinstance(preload_module_classes, str):
        return {preload_module_classes}
    names = set()
    for c in preload_module_classes:
        if isinstance(c, str):
            names.add(c)
        elif isinstance(c, type):
            names.add(c.__name__)
        else:
            raise TypeError(f"preload_module_classes must hold class names (str) or classes, got {c!r}")
    return names


def check(preload_module_classes):
    """The set of class names; TypeError on anything else."""
    return _class_names(preload_module_classes)


def attach(engine, class_names):
    """Registers the hooks on every module of the model whose class is named in `class_names`."""
    if not class_names:
        return
    by_module = {id(u.module): u for u in engine.units}
    for module in engine.model.modules():
        if type(module).__name__ not in class_names:
            continue
        units = [by_module[id(m)] for m in module.modules() if id(m) in by_module]
        if units:
            engine.handles.append(module.register_forward_pre_hook(_enter_all(engine, units)))
            engine.handles.append(module.register_forward_hook(_leave_all(engine, units), always_call=True))


def _enter_all(engine, units):
    def pre(module, args):
        entered = []
        try:
            for unit in units:
                engine.enter(unit)
                entered.append(unit)
        except BaseException:
            for unit in reversed(entered):
                engine.leave(unit, None)
            raise
    return pre


def _leave_all(engine, units):
    def post(module, args, output):
        for unit in reversed(units):
            output = engine.leave(unit, output)
        return output
    return post
