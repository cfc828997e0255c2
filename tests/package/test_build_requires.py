"""The README's development command starts with .ci/install-build-requires, on any Python the README names
(>= 3.9): it reads pyproject.toml's build requirements with tomllib where Python has it (3.11) and without it
on 3.9 and 3.10, where importing tomllib failed before. Both give the same list."""
import os
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # the reference list (Python >= 3.11)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, ".ci", "install-build-requires")


def _listed(env):
    r = subprocess.run(["bash", SCRIPT, "--list"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_build_requires_are_read_with_and_without_tomllib(tmp_path):
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        want = tomllib.load(f)["build-system"]["requires"]
    assert want and _listed(dict(os.environ)) == want
    (tmp_path / "tomllib.py").write_text("raise ModuleNotFoundError(\"No module named 'tomllib'\")\n")  # as on 3.10
    python = tmp_path / "bin"
    python.mkdir()
    (python / "python").symlink_to(sys.executable)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PATH": f"{python}{os.pathsep}{os.environ['PATH']}"}
    assert _listed(env) == want
