"""A disk that refuses the writes for real (no monkeypatched handle): a child process whose file size limit
(RLIMIT_FSIZE, SIGXFSZ ignored) is below one forward's activations. The forward fails with the write's OSError
(EFBIG), leaving no hooks, swap file or session; with the limit lifted the next step's gradients equal the run
without offload."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import errno, json, os, resource, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from helpers.activations import assert_same_grads, batch, grads_of, hooks_installed, make_stack, swap_files
    from swapio.offload import offload_activations

    model, x = make_stack(), batch(b=2, t=256)
    want = grads_of(model, x)
    act = offload_activations(to="nvme", swap_dir={swap!r}, model=model, min_bytes=0, staging_bytes=0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    try:
        grads_of(model, x, act)
        failed = None
    except OSError as exc:
        failed = exc.errno
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    left = dict(hooks=hooks_installed(), files=swap_files(act.directory), sessions=act.stats()["live_sessions"])
    assert_same_grads(grads_of(model, x, act), want)
    print(json.dumps(dict(errno=failed, efbig=errno.EFBIG, **left)))
""")


@pytest.mark.slow  # (a child process)
def test_writes_past_the_file_size_limit_fail_the_forward_and_leave_nothing(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = os.path.dirname(tests)
    out = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests, swap=str(tmp_path))], cwd=repo,
                         env={**os.environ, "PYTHONPATH": repo}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["errno"] == got["efbig"]
    assert got["hooks"] is False and got["files"] == [] and got["sessions"] == 0
