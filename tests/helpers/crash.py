"""Signalling child processes at a moment of their work: killing a saver at a random moment of its save (the
crash tests of optimizer checkpoints, test_optim_save_crash.py, and of swapio.checkpoint, test_checkpoint_crash.py),
and waiting until a child says it has reached the point where the test signals it."""
import multiprocessing.connection
import os
import signal
import time

import pytest

from conftest import TIMEOUT


def wait_ready(conn, proc, what, timeout=TIMEOUT):
    """Waits until the child `proc` sends on `conn` (the reading end of a one-way Pipe whose writing end only the
    child holds) that it has reached `what`; fails the test if the child ends or `timeout` seconds pass first."""
    if conn not in multiprocessing.connection.wait([conn, proc.sentinel], timeout):
        pytest.fail(f"the child did not reach {what} within {timeout} s (exit code {proc.exitcode})")
    try:
        conn.recv()
    except EOFError:
        proc.join(TIMEOUT)
        pytest.fail(f"the child ended (exit code {proc.exitcode}) before it reached {what}")


def kill_while_saving(ctx, saver, args_of, sig, deadline, delay):
    """Starts saver(*args_of(saved, saving)) in a process, waits until its first save is under way (saving set)
    or done (saved >= 0), sleeps `delay` seconds, sends `sig` and reaps it. Returns (saved, was_saving): the shared
    Value of the last save it completed, and whether a save was under way when the signal was sent."""
    saved, saving = ctx.Value("q", -1, lock=False), ctx.Value("b", 0, lock=False)
    proc = ctx.Process(target=saver, args=args_of(saved, saving), daemon=True)
    proc.start()
    while saved.value < 0 and saving.value == 0:
        assert proc.is_alive() and time.monotonic() < deadline, "the saver never started"
        time.sleep(0.001)
    time.sleep(delay)
    was_saving = saving.value
    os.kill(proc.pid, sig)
    proc.join(30)
    if proc.exitcode is None and sig == signal.SIGINT:
        # Python swallows a KeyboardInterrupt raised while a finalizer runs (printed as "Exception ignored in"),
        # and the saver went on saving: as a user whose first Ctrl-C was lost, press it again
        os.kill(proc.pid, sig)
        proc.join(30)
    assert proc.exitcode is not None
    return saved, was_saving
