"""A fork server for tests that run code in child processes: children fork from a server that imported the
child modules (and torch, swapio) once, so each starts in milliseconds instead of seconds."""
import faulthandler
import multiprocessing
import os
import signal
import time

import pytest

from conftest import REPO, TIMEOUT

CHILD_MODULES = [f"helpers.{name}" for name in ("matrix_child", "leftover_children", "memory_child",
                                                "train_budget_child")]


@pytest.fixture(scope="module")
def forkserver():
    """The forkserver context. Python 3.11's fork server ignores sys.path: it gets the path through the
    environment when it starts (if another test started it already, the modules are imported on first use)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(CHILD_MODULES)
    yield ctx
    if before is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = before


def run_child(ctx, target, *args, timeout=120):
    """Runs target(*args) in a child of the fork server; returns its exit code."""
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    proc.join(timeout)
    assert proc.exitcode is not None, f"{target.__name__} did not end within {timeout} s"
    return proc.exitcode


def run_in_child(body):
    """Runs body() in a forked child; returns its exit status (0: body passed). Kills a child that hangs."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        faulthandler.dump_traceback_later(TIMEOUT / 2, exit=True)  # a hang says where
        code = 1
        try:
            body()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the exit status
            os.write(2, f"child failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not exit within {TIMEOUT} s")
