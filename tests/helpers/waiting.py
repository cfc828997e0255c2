"""Waiting for a condition that another thread or process makes true, failing loudly when it never does."""
import time

from conftest import TIMEOUT


def wait_until(condition, what, timeout=TIMEOUT):
    """Returns once condition() is true; raises AssertionError naming `what` if `timeout` seconds pass first (an
    AssertionError, not pytest's Failed, so that it also propagates out of autograd hooks and worker threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.001)
