"""Ctrl-C (SIGINT) and kill (SIGTERM) in the middle of `python -m swapio bench`: the temporary file goes."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_run_removes_the_temporary_file(tmp_path, sig, status):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "swapio", "bench", "--dir", str(tmp_path), "--size", "8M",
                             "--bs", "256K", "--runtime", "60", "-q"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # SIGINT at its default even where the tests run with it ignored (a background
                            # job of a non-interactive shell): Python then installs its Ctrl-C handler
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not any(f.startswith("swapio-bench-") for f in os.listdir(tmp_path)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the benchmark never started"
            time.sleep(0.05)
        time.sleep(0.5)  # mid-run
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] in ("swapio bench: interrupted", "swapio bench: terminated")
    assert os.listdir(tmp_path) == []
