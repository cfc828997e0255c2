"""A process at its thread limit (ulimit -u, a container's pids.max): pthread_create refused with EAGAIN, through
an LD_PRELOAD shim, in a fresh interpreter (helpers/thread_limit_child.py says what each path must do)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

HELPERS = os.path.join(REPO, "tests", "helpers")


@pytest.fixture
def refuse_threads_shim(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the pthread_create shim")
    shim = tmp_path / "refuse_threads.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(shim), os.path.join(HELPERS, "refuse_threads.c"),
                    "-ldl"], check=True)
    return shim


def test_paths_at_the_thread_limit_fail_clearly_and_recover(refuse_threads_shim, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(refuse_threads_shim)]))  # (ASan's first)
    env = dict(os.environ, LD_PRELOAD=preload, PYTHONPATH=os.pathsep.join([REPO, HELPERS]), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-X", "faulthandler", os.path.join(HELPERS, "thread_limit_child.py"),
                          str(work)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "passed" in out.stdout, out.stdout[-3000:] + out.stderr[-5000:]
