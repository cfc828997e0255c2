"""The message for `import swapio` when the native module swapio._C cannot be loaded.

The usual cause: Python runs inside swapio's source tree (after `pip install .`, `python -m swapio` or a snippet
started from the checkout), so `import swapio` finds the source directory, which holds no compiled _C, instead
of the installed package. Python's own message ("partially initialized module ... circular import") hides that,
so it is never repeated here. Only a file this interpreter would load is the native module: the typed stub
_C.pyi is not, and neither is an extension built for another Python (another ABI tag).
"""
import glob
import importlib.machinery
import os


def _extensions(package_dir: str) -> "tuple[list[str], list[str]]":
    """(the _C extension files this Python would load, those built for another Python) in package_dir."""
    loadable = [path for suffix in importlib.machinery.EXTENSION_SUFFIXES
                for path in [os.path.join(package_dir, "_C" + suffix)] if os.path.isfile(path)]
    others = sorted(path for pattern in ("_C.*.so", "_C.*.pyd")
                    for path in glob.glob(os.path.join(package_dir, pattern)) if path not in loadable)
    return loadable, others


def explain(package_dir: str, exc: BaseException) -> str:
    package_dir = os.path.abspath(package_dir)
    source_tree = os.path.dirname(package_dir)
    rebuild = f"`python setup.py build_ext --inplace` in {source_tree}"
    loadable, others = _extensions(package_dir)
    if loadable:  # a build for this Python exists but does not load (missing symbol, damaged file, ...)
        return (f"swapio's native module {loadable[0]} failed to load ({exc}). Rebuild it for this Python: "
                f"{rebuild}, or `pip install .`.")
    if others:
        return (f"swapio's native module _C in {package_dir} is built for another Python "
                f"({', '.join(os.path.basename(p) for p in others)}), not this one "
                f"({importlib.machinery.EXTENSION_SUFFIXES[0]}). Rebuild it with this Python: {rebuild}, or run "
                "from another directory so the installed swapio is used (`pip install .` builds and installs it).")
    where = ""
    if os.path.isfile(os.path.join(source_tree, "setup.py")):
        where = (f" This is swapio's source tree ({source_tree}), whose swapio/ has no compiled _C: Python "
                 "imports it instead of an installed swapio because the working directory (or sys.path) comes "
                 "first.")
    return (f"swapio's native module _C is not built in {package_dir}.{where} Either build it in place "
            f"({rebuild}) or run from another directory so the installed swapio is used (`pip install .` builds "
            "and installs it).")
