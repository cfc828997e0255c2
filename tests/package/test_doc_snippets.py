"""Every ```python block in README.md and docs/*.md runs as written, in order within its file (later blocks may
use what earlier ones made), in a fresh process whose working directory is an empty scratch directory. The
shell examples are not run; what they would leave behind and a snippet reads (a `swapio tune` config) is put
in the scratch directory first."""
import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
TUNE_CONFIG = {"handle": {"block_size": 1 << 20, "queue_depth": 32, "threads": 1, "engine": "auto", "direct": None},
               "read": {"block_size": 1 << 20, "queue_depth": 32, "threads": 1, "engine": "auto", "direct": None},
               "write": {"block_size": 1 << 20, "queue_depth": 16, "threads": 1, "engine": "auto", "direct": None},
               "measured": {}}

RUNNER = r"""
import json, sys, traceback
ns = {"__name__": "__main__"}
for where, code in json.load(open(sys.argv[1])):
    try:
        exec(compile(code, where, "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"snippet at {where} failed", file=sys.stderr)
        sys.exit(1)
"""


def python_blocks(path):
    """[(\"FILE:LINE\", code)] for each ```python block of a markdown file."""
    blocks, code, start = [], None, 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            stripped = line.strip()
            if code is None and stripped == "```python":
                code, start = [], lineno + 1
            elif code is not None and stripped == "```":
                blocks.append((f"{os.path.relpath(path, REPO)}:{start}", "".join(code)))
                code = None
            elif code is not None:
                code.append(line)
    return blocks


DOCS_WITH_CODE = [d for d in DOCS if python_blocks(d)]


def test_the_readme_and_the_docs_have_snippets():
    assert os.path.join(REPO, "README.md") in DOCS_WITH_CODE and len(DOCS_WITH_CODE) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS_WITH_CODE, ids=lambda d: os.path.relpath(d, REPO))
def test_snippets_run_in_order(doc, tmp_path):
    scratch = tmp_path / "scratch-cwd"
    scratch.mkdir()
    (scratch / "swapio-io.json").write_text(json.dumps(TUNE_CONFIG))
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps(python_blocks(doc)))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", RUNNER, str(blocks)], cwd=scratch, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
