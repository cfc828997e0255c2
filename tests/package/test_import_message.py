"""`import swapio` from a source tree without a built native module says what is wrong and what to do, instead
of Python's "partially initialized module ... (most likely due to a circular import)"."""
import importlib.machinery
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# An editable install (pip install -e .) adds a finder that would lend the tree its own built _C; the user's
# case is a regular install, so the test imports without that finder.
_IMPORT_AS_AFTER_A_REGULAR_INSTALL = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in str(getattr(f, '__module__', ''))]; "
    "import swapio")


def _import_in(tree):
    return subprocess.run([sys.executable, "-c", _IMPORT_AS_AFTER_A_REGULAR_INSTALL], cwd=tree,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})


def _unbuilt_checkout(tmp_path):
    """A copy of the source tree as a fresh clone has it: the stub swapio/_C.pyi, no compiled extension."""
    tree = tmp_path / "checkout"
    shutil.copytree(os.path.join(REPO, "swapio"), tree / "swapio",
                    ignore=shutil.ignore_patterns(*("_C" + s for s in importlib.machinery.EXTENSION_SUFFIXES),
                                                  "_C.*.so", "__pycache__"))
    assert (tree / "swapio" / "_C.pyi").is_file()  # the stub: no native module, whatever its name says
    shutil.copy(os.path.join(REPO, "setup.py"), tree / "setup.py")
    return tree


def test_unbuilt_source_tree_explains_the_fix(tmp_path):
    tree = _unbuilt_checkout(tmp_path)
    r = _import_in(tree)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "circular import" not in r.stderr
    assert last.startswith("ImportError: swapio's native module _C is not built in")
    assert "source tree" in last and "build_ext --inplace" in last and "another directory" in last


def test_broken_build_names_the_file(tmp_path):
    tree = _unbuilt_checkout(tmp_path)
    # named as this interpreter names its extensions (cpython-311 on CI, cpython-312 elsewhere), so it is found
    (tree / "swapio" / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not an ELF file")
    r = _import_in(tree)
    assert r.returncode != 0 and "circular import" not in r.stderr
    assert "failed to load" in r.stderr and "Rebuild it" in r.stderr


def test_a_build_for_another_python_is_named_without_python_s_circular_import_text(tmp_path):
    tree = _unbuilt_checkout(tmp_path)
    other = tree / "swapio" / "_C.cpython-20-x86_64-linux-gnu.so"  # no interpreter loads this suffix
    other.write_bytes(b"built elsewhere")
    r = _import_in(tree)
    assert r.returncode != 0 and "circular import" not in r.stderr and "partially initialized" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "_C.pyi" not in last
    assert other.name in last and "another Python" in last and "build_ext --inplace" in last
