"""The message for `import swapio` when the native module swapio._C cannot be loaded.

The usual cause: Python runs inside swapio's source tree (after `pip install .`, `python -m swapio` or a snippet
started from the checkout), so `import swapio` finds the source directory, which holds no compiled _C, instead
of the installed package. Python's own message ("partially initialized module ... circular import") hides that.
"""
import glob
import os


def explain(package_dir: str, exc: BaseException) -> str:
    package_dir = os.path.abspath(package_dir)
    source_tree = os.path.dirname(package_dir)
    built = glob.glob(os.path.join(package_dir, "_C.*"))
    if built:  # a build exists but does not load (other Python, missing symbol, ...)
        return (f"swapio's native module {built[0]} failed to load ({exc}). Rebuild it for this Python: "
                f"`python setup.py build_ext --inplace` in {source_tree}, or `pip install .`.")
    where = ""
    if os.path.isfile(os.path.join(source_tree, "setup.py")):
        where = (f" This is swapio's source tree ({source_tree}), whose swapio/ has no compiled _C: Python "
                 "imports it instead of an installed swapio because the working directory (or sys.path) comes "
                 "first.")
    return (f"swapio's native module _C is not built in {package_dir}.{where} Either build it in place "
            f"(`python setup.py build_ext --inplace` in {source_tree}) or run from another directory so the "
            "installed swapio is used (`pip install .` builds and installs it).")
