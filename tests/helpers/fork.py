"""A fork server for tests that run code in child processes: children fork from a server that imported the
child modules (and torch, swapio) once, so each starts in milliseconds instead of seconds."""
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time

import pytest
import torch

from conftest import REPO, TIMEOUT

# Every module the tests' children run, imported once by the one fork server of the session (with torch and
# swapio, and each module's warm-up): a child then starts in milliseconds, where one that imported its module
# itself paid a second or more.
CHILD_MODULES = ["torch", "swapio"] + [f"helpers.{name}" for name in (
    "matrix_child", "leftover_children", "memory_child", "train_budget_child", "optim_save_crash_child",
    "checkpoint_crash_child", "offload_crash_child", "export_crash_child", "offload_training")]


def fork_server():
    """The forkserver context, its server started with CHILD_MODULES preloaded. The server is one per process and
    starts once: every test that forks from it goes through here, so that none starts it without the modules (then
    every child of the session imported them itself). Python 3.11's fork server ignores sys.path: it gets the path
    through the environment at its start, which is restored afterwards."""
    ctx = multiprocessing.get_context("forkserver")
    if not _started:
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
        try:
            ctx.set_forkserver_preload(CHILD_MODULES)
            multiprocessing.forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        _started.append(True)
    return ctx


_started: list = []


@pytest.fixture
def forkserver():
    """The forkserver context (fork_server)."""
    return fork_server()


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
        # torch's OpenMP pool does not survive a fork: a child's first parallel op hung where the parent had used
        # it (2 cores and more); one thread, as DataLoader's workers run (swapio's kernels give the same bits)
        torch.set_num_threads(1)
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
