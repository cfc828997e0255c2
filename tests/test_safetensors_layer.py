"""The safetensors format has one home below checkpoint and offload: swapio.safetensors imports only swapio.core;
swapio.checkpoint never imports swapio.offload (nor anything above it); swapio.offload reaches swapio.checkpoint
only through its public names. Every import counts, one inside a function included."""
import ast
import pathlib

import pytest

import swapio
import swapio.checkpoint

ROOT = pathlib.Path(swapio.__file__).parent


def _imports(source, module):
    """[(line, imported module, names)] of the swapio imports in `source`, the text of the module `module`
    (dotted; a package as its __init__), relative imports resolved."""
    package = module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("swapio")]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.startswith("swapio"):
                out.append((node.lineno, target, [a.name for a in node.names]))
    return out


def _modules(package):
    """(path, dotted module name) of every source file of a swapio package."""
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ".".join(("swapio", *path.relative_to(ROOT).with_suffix("").parts))


def _package(module):
    return module.split(".")[1] if module.count(".") else ""


def _check(package, refused):
    bad = []
    for path, module in _modules(package):
        bad += [f"{path.relative_to(ROOT)}:{line}: {target} {names}"
                for line, target, names in _imports(path.read_text(), module) if refused(target, names)]
    return bad


def test_safetensors_imports_only_core():
    assert _check("safetensors", lambda target, names: _package(target) not in ("safetensors", "core")
                  and not (target == "swapio" and names == ["_C"])) == []


def test_checkpoint_imports_neither_offload_nor_anything_above():
    above = ("offload", "optim", "integrations", "tools")
    assert _check("checkpoint", lambda target, names: _package(target) in above
                  or (target == "swapio" and any(n in above for n in names))) == []


def test_offload_imports_only_the_public_names_of_checkpoint():
    public = set(swapio.checkpoint.__all__)
    assert _check("offload", lambda target, names: target.startswith("swapio.checkpoint.")
                  or (target == "swapio.checkpoint" and not set(names) <= public)) == []


def test_the_checker_resolves_relative_and_function_level_imports():
    source = "import os\nfrom . import layout\n\ndef f():\n    from ..offload.load import read_into\n"
    assert _imports(source, "swapio.checkpoint.load") == [(2, "swapio.checkpoint", ["layout"]),
                                                          (5, "swapio.offload.load", ["read_into"])]
    assert _imports("from ...core import _durable\n", "swapio.optim.checkpoint.files") == \
        [(1, "swapio.core", ["_durable"])]
    package_init = "from .writer import write\n"
    assert _imports(package_init, "swapio.optim.checkpoint.__init__") == [(1, "swapio.optim.checkpoint.writer",
                                                                           ["write"])]
