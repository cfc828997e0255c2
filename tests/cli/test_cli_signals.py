"""Ctrl-C (SIGINT) and kill (SIGTERM) in the middle of `python -m swapio bench`: the temporary file goes.

The command runs as `python -m swapio` runs it, with one addition: once its measured phase has requests in flight,
it writes a byte to a pipe and waits there, so the test's signal lands mid-run, every time."""
import os
import select
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.crash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 60

CHILD = """
import os, runpy, sys, time
from swapio.tools import loadgen

ready = int(sys.argv.pop(1))
real_pump = loadgen.pump
waited = []


def pump(submit, **kwargs):
    def submit_then_wait(k, measured):
        request = submit(k, measured)
        if k >= loadgen.OUTSTANDING and measured is not None and not waited:  # the queue full, measured: mid-run
            waited.append(k)
            os.write(ready, b"r")
            time.sleep(%d)  # the signal comes here
        return request
    return real_pump(submit_then_wait, **kwargs)


loadgen.pump = pump
sys.argv[0] = "swapio"
runpy.run_module("swapio", run_name="__main__", alter_sys=True)
""" % TIMEOUT


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_run_removes_the_temporary_file(tmp_path, sig, status):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ready, ready_in_child = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ready_in_child), "bench", "--dir", str(tmp_path),
                             "--size", "8M", "--bs", "256K", "--runtime", str(TIMEOUT), "-q"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(ready_in_child,),
                            # SIGINT at its default even where the tests run with it ignored (a background
                            # job of a non-interactive shell): Python then installs its Ctrl-C handler
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(ready_in_child)
    try:
        readable, _, _ = select.select([ready], [], [], TIMEOUT)
        got = os.read(ready, 1) if readable else None
        assert got == b"r", f"the benchmark never got mid-run: {proc.communicate() if got == b'' else 'timed out'}"
        assert any(f.startswith("swapio-bench-") for f in os.listdir(tmp_path)), "no temporary file mid-run"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        os.close(ready)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] in ("swapio bench: interrupted", "swapio bench: terminated")
    assert os.listdir(tmp_path) == []
