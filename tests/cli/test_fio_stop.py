"""A fio run cut short (its time limit, Ctrl-C, SIGTERM of `swapio bench --compare-fio`) stops fio whole: its job
processes too. fio forks one per job; killing only the main one left them running on, for the rest of --runtime,
on the (already removed) benchmark file."""
import os
import signal
import threading
import time

import pytest

from swapio.tools import fiocompare

# fio's shape: a main process that forks a worker and waits for it
FAKE_FIO = """#!/bin/sh
sleep 60 &
echo $! > "$1"
wait
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has stopped
    except FileNotFoundError:
        return False


def _worker_of(fake, pidfile):
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the fake fio never started its worker"
        time.sleep(0.01)
    return int(pidfile.read_text())


def _gone(pid):
    deadline = time.monotonic() + 2
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _alive(pid)


@pytest.fixture
def fake_fio(tmp_path):
    path = tmp_path / "fio"
    path.write_text(FAKE_FIO)
    path.chmod(0o755)
    pidfile = tmp_path / "worker.pid"
    yield [str(path), str(pidfile)], pidfile
    if pidfile.exists() and pidfile.read_text().strip() and _alive(int(pidfile.read_text())):
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_time_limit_stops_fio_and_its_workers(fake_fio):
    cmd, pidfile = fake_fio
    with pytest.raises(fiocompare.FioError, match="did not finish within"):
        fiocompare.run_fio(cmd, timeout=0.5)
    assert _gone(_worker_of(cmd, pidfile))


def test_ctrl_c_stops_fio_and_its_workers(fake_fio):
    cmd, pidfile = fake_fio

    def interrupt_once_started():
        _worker_of(cmd, pidfile)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C of the command, as the main thread waits for fio

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        fiocompare.run_fio(cmd, timeout=30)
    assert _gone(_worker_of(cmd, pidfile))
