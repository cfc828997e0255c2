"""Ctrl-C (SIGINT), kill (SIGTERM) and kill -9 (SIGKILL) in the middle of `python -m swapio bench`: the temporary
file goes. It never has a name in the directory, so even a SIGKILL, which no handler sees, leaves nothing there.

The command runs as `python -m swapio` runs it, with one addition: once its measured phase has requests in flight,
it writes a byte to a pipe and waits there, so the test's signal lands mid-run, every time."""
import glob
import os
import signal
import sys

import pytest

from helpers.cli import signal_once_ready

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


def files_open_in(directory):
    """What any process has open in `directory` (an unnamed file shows as '<directory>/#<inode> (deleted)')."""
    found = []
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for fd in fds:
            try:  # one at a time: a descriptor closed meanwhile (an I/O request's, as the run's requests finish)
                link = os.readlink(os.path.join(fd_dir, fd))  # skipped the whole process, the run's file included
            except OSError:
                continue
            if link.startswith(str(directory) + os.sep):
                found.append(link)
    return found


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_signal_mid_run_removes_the_temporary_file(tmp_path, sig, status):
    def start(fd):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return [sys.executable, "-c", CHILD, str(fd), "bench", "--dir", str(tmp_path), "--size", "8M", "--bs",
                "256K", "--runtime", str(TIMEOUT), "-q"], env

    named, unnamed = [], []

    def mid_run():
        named.extend(os.listdir(tmp_path))
        unnamed.extend(files_open_in(tmp_path))

    status_got, err = signal_once_ready(start, sig, TIMEOUT, when_ready=mid_run)
    assert status_got == status, err
    assert named == [] and len(set(unnamed)) == 1, (named, unnamed)  # one file (the run's), in the directory, no name
    assert os.listdir(tmp_path) == []
    if sig == signal.SIGKILL:
        return
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] in ("swapio bench: interrupted", "swapio bench: terminated")
    assert os.listdir(tmp_path) == []
