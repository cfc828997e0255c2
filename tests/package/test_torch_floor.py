"""`import swapio` on a torch older than swapio supports raises an ImportError naming the version needed (instead
of a crash or a wrong result later), and pyproject.toml, README.md and the check name the same version."""
import os
import re
import subprocess
import sys

import pytest

from swapio import _torch_floor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEED = "{}.{}".format(*_torch_floor.MINIMUM)


def _import_with_torch_version(version):
    """`import swapio` in a child whose torch reports `version` (set before swapio reads it)."""
    code = f"import torch; torch.__version__ = {version!r}; import swapio; print('imported')"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_an_older_torch_is_refused_at_import_naming_the_version_needed():
    older = f"{_torch_floor.MINIMUM[0]}.{_torch_floor.MINIMUM[1] - 1}.1+cu124"
    r = _import_with_torch_version(older)
    assert r.returncode != 0 and "imported" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: swapio needs torch >= {NEED}, but this Python has torch {older}"), last


def test_the_oldest_supported_torch_imports():
    r = _import_with_torch_version(f"{NEED}.0+cpu")
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr


@pytest.mark.parametrize("version, expected", [
    ("2.14.1+cu130", (2, 14)), ("2.6.0", (2, 6)), ("2.6.0a0+git1234abc", (2, 6)), ("2.7.0.dev20250101", (2, 7)),
    ("2.10.0", (2, 10)), ("3.0.0", (3, 0)), ("2.1.2+cu121", (2, 1))])
def test_versions_are_compared_by_number_not_text(version, expected):
    assert _torch_floor.parse(version) == expected  # as text, "2.10" < "2.6"
    if expected >= _torch_floor.MINIMUM:
        _torch_floor.check(version)
    else:
        with pytest.raises(ImportError, match=re.escape(f"torch >= {NEED}")):
            _torch_floor.check(version)


def test_an_unreadable_version_is_refused():
    with pytest.raises(ImportError, match="cannot read torch's version 'unknown'"):
        _torch_floor.check("unknown")


def test_pyproject_and_readme_name_the_checked_floor():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        deps = re.search(r'^dependencies = \[(.*)\]', f.read(), re.M).group(1)
    assert f'"torch>={NEED}"' in deps
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert f"swapio works with any torch ≥ {NEED} " in readme
    assert f"**Supported torch versions.** torch ≥ {NEED} " in readme
