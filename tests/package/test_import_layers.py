"""The package's layers import only downward, and no modules import each other in a circle.

Layers, lowest first (docs/design.md draws them): core (with the native module and the leaf helpers at the top
of the package) <- kernels <- safetensors <- checkpoint <- offload <- optim <- {integrations, tools} <- the
package itself. A module may import its own layer and those below; every import counts, those inside functions
too (a function-level import that dodges a cycle is still the cycle). Read from the source with ast, so the test
needs no native build and imports nothing.
"""
import ast
import pathlib
import shutil
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "swapio"
if not PACKAGE.is_dir():  # the tests sit one folder deeper
    PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "swapio"

# the first dotted component under swapio -> its layer
LAYERS = {
    "_C": 0, "_env": 0, "_interrupt": 0, "_native_missing": 0, "_progress": 0, "_torch_floor": 0, "_version": 0,
    "core": 0,
    "kernels": 1, "swap": 1,
    "safetensors": 2,
    "checkpoint": 3,
    "offload": 4,
    "optim": 5,
    "integrations": 6, "tools": 6, "info": 6,
    "": 7, "__main__": 7,
}


def module_name(path: pathlib.Path) -> str:
    parts = ("swapio",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, known: set) -> list:
    """(line, imported module) for every swapio import in the file, wherever it sits."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "swapio"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "swapio":
                continue
            for alias in node.names:  # `from pkg import mod` imports the module; `from pkg import name`, pkg
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return found


def layer_of(name: str) -> int:
    first = name.split(".")[1] if "." in name else ""
    assert first in LAYERS, f"{name}: no layer declared for swapio.{first} (add it to LAYERS and docs/design.md)"
    return LAYERS[first]


def graph() -> dict:
    files = modules()
    known = set(files) | {"swapio._C"}  # the native module: a built extension, not a .py file
    return {name: imports_of(name, path, known) for name, path in files.items()}


def test_every_import_points_down_or_sideways_within_its_package():
    upward = []
    for name, edges in graph().items():
        for line, target in edges:
            if target == name or target == "swapio._C":
                continue
            if layer_of(target) > layer_of(name):
                upward.append(f"{name}:{line} imports {target}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    edges = {name: sorted({t for _, t in e if t != name}) for name, e in graph().items()}
    # Tarjan's strongly connected components; a component of more than one module is a circle
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    # A package's __init__ re-exports its modules, and a module may import a sibling through the package: that
    # pair is not a circle of code. Anything else is.
    real = [c for c in circles if not _only_package_reexports(c, edges)]
    assert not real, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in real)


def _only_package_reexports(component, edges):
    inits = [m for m in component if any(o.startswith(m + ".") for o in component)]
    rest = [m for m in component if m not in inits]
    # without the package __init__s the rest must be acyclic
    sub = {m: [t for t in edges[m] if t in rest] for m in rest}
    seen, done = set(), set()

    def cyclic(v):
        seen.add(v)
        for w in sub[v]:
            if w in seen and w not in done:
                return True
            if w not in seen and cyclic(w):
                return True
        done.add(v)
        return False

    return bool(inits) and not any(cyclic(v) for v in rest if v not in seen)


def test_offload_uses_checkpoint_through_its_public_names_only():
    """offload/ sits beside checkpoint/ on the safetensors layer: it may save and load through swapio.checkpoint's
    public calls, never through the modules behind them."""
    import swapio.checkpoint  # the one import: the public names are what the package exports
    public, bad = set(swapio.checkpoint.__all__), []
    files = modules()
    for name, path in files.items():
        if not name.startswith("swapio.offload"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and "checkpoint" in node.module.split("."):
                names = {a.name for a in node.names}
                inner = node.module.split(".")[-1] != "checkpoint"
                if inner or not names <= public:
                    bad.append(f"{name}:{node.lineno} imports {sorted(names)} from {node.module}")
    assert not bad, "offload reaches into checkpoint:\n" + "\n".join(bad)


@pytest.mark.parametrize("bad, expect", [
    ("from ..optim import offloaded\n", "imports that go up a layer"),
])
def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch, bad, expect):
    """The checker itself: an upward import planted in a copy of the tree is reported."""

    copy = tmp_path / "swapio"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (copy / "core" / "planted.py").write_text("def f():\n    " + bad)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    with pytest.raises(AssertionError, match=expect):
        test_every_import_points_down_or_sideways_within_its_package()


def test_the_checker_sees_a_circle(tmp_path, monkeypatch):

    copy = tmp_path / "swapio"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (copy / "core" / "planted_a.py").write_text("from . import planted_b\n")
    (copy / "core" / "planted_b.py").write_text("def f():\n    from . import planted_a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    with pytest.raises(AssertionError, match="in a circle"):
        test_no_modules_import_each_other_in_a_circle()
