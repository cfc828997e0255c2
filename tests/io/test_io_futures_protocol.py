"""swapio futures against concurrent.futures habits: cancel/cancelled/running answer as for a running
concurrent.futures.Future, add_done_callback calls back once (a raising callback is logged, as there), and
concurrent.futures.wait/as_completed, which need their own Future's internals, fail with a TypeError saying so
(they raised an AttributeError on '_condition'). Reference: concurrent.futures' own Future."""
import concurrent.futures as cf
import logging
import threading

import pytest
import torch

import swapio
from conftest import TIMEOUT


@pytest.fixture
def handle(tmp_path):
    with swapio.AioHandle() as h:
        yield h


def test_cancel_is_refused_as_for_a_running_concurrent_future(handle, tmp_path):
    reference = cf.Future()
    reference.set_running_or_notify_cancel()
    f = handle.pwrite(torch.arange(1 << 20, dtype=torch.float32), tmp_path / "f")
    assert f.cancel() is reference.cancel() is False
    assert f.cancelled() is reference.cancelled() is False
    assert f.wait(TIMEOUT) == 4 << 20
    assert f.running() is False and f.done() and f.cancel() is False


def test_done_callback_is_called_once_with_the_future(handle, tmp_path):
    calls, called = [], threading.Event()

    def record(fut):
        calls.append((fut, fut.result()))
        called.set()

    t = torch.arange(1 << 22, dtype=torch.float32)
    f = handle.pwrite(t, tmp_path / "f")
    f.add_done_callback(record)
    f.add_done_callback(lambda fut: calls.append("second"))
    assert f.wait(TIMEOUT) == t.nbytes
    assert called.wait(TIMEOUT)
    handle.wait()
    assert calls[0] == (f, t.nbytes)
    late = []
    f.add_done_callback(lambda fut: late.append(threading.current_thread()))  # done: at once, in this thread
    assert late == [threading.current_thread()]
    for _ in range(100):  # the watcher's second call lands after the first
        if len(calls) == 2:
            break
        threading.Event().wait(0.01)
    assert calls[1:] == ["second"]


def test_a_raising_callback_is_logged_and_the_others_still_run(handle, tmp_path, caplog):
    ran = threading.Event()
    f = handle.pwrite(torch.ones(1 << 20), tmp_path / "f")

    def boom(fut):
        raise ValueError("callback error")
    f.add_done_callback(boom)
    f.add_done_callback(lambda fut: ran.set())
    with caplog.at_level(logging.ERROR, logger="swapio"):
        assert f.wait(TIMEOUT) == 4 << 20
        assert ran.wait(TIMEOUT)
    assert any("callback" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError, match="callable"):
        f.add_done_callback(None)


def test_concurrent_futures_wait_and_as_completed_fail_clearly(handle, tmp_path):
    f = handle.pwrite(torch.ones(16), tmp_path / "f")
    for use in (lambda: cf.wait([f], timeout=TIMEOUT), lambda: list(cf.as_completed([f], timeout=TIMEOUT))):
        with pytest.raises(TypeError, match="concurrent.futures"):
            use()
    assert not hasattr(f, "_condition")  # introspection is not broken by it
    f.wait(TIMEOUT)


def bridge(f):
    """The docs' recipe: a concurrent.futures.Future settled by a swapio future's callback."""
    c = cf.Future()
    c.set_running_or_notify_cancel()

    def settle(done):
        error = done.exception()
        c.set_exception(error) if error is not None else c.set_result(done.result())
    f.add_done_callback(settle)
    return c


def test_the_documented_bridge_works_with_concurrent_futures(handle, tmp_path):
    t = torch.arange(1 << 20, dtype=torch.float32)
    handle.pwrite(t, tmp_path / "f").wait(TIMEOUT)
    back = torch.empty_like(t)
    ok = bridge(handle.pread(back, tmp_path / "f"))
    bad = bridge(handle.pread(torch.empty(16), tmp_path / "f", offset=1 << 30))
    done, not_done = cf.wait([ok, bad], timeout=TIMEOUT)
    assert not not_done and ok.result() == t.nbytes and torch.equal(back, t)
    assert isinstance(bad.exception(), OSError) and bad.exception().filename == str(tmp_path / "f")


def test_get_waits_as_kvikio_iofuture_get_does(handle, tmp_path):
    """kvikio's CuFile.pread/pwrite return an IOFuture whose get() blocks and returns the bytes moved."""
    t = torch.arange(1 << 16, dtype=torch.float32)
    assert handle.pwrite(t, tmp_path / "f").get() == t.nbytes
    back = torch.empty_like(t)
    assert handle.pread(back, tmp_path / "f").get() == t.nbytes and torch.equal(back, t)
    with pytest.raises(OSError):
        handle.pread(torch.empty(16), tmp_path / "f", offset=1 << 30).get()


class GatedRequest:
    """A native request's interface (done, wait) finishing when the test opens the gate."""

    def __init__(self, gate):
        self.gate = gate

    def done(self):
        return self.gate.is_set()

    def wait(self, timeout=None):
        return self.gate.wait(timeout)

    def result(self):
        return 7


def test_many_futures_with_callbacks_share_one_watcher_thread():
    """A thread per future waiting for its callbacks made 200 threads for 200 reads bridged to concurrent.futures."""
    from swapio.core.futures import Future
    gate = threading.Event()
    futures = [Future(GatedRequest(gate), then=lambda n: n) for _ in range(200)]
    called = []
    for f in futures:
        f.add_done_callback(lambda fut: called.append(fut))
    watchers = [th for th in threading.enumerate() if th.name == "swapio-future-callbacks"]
    assert len(watchers) == 1 and not called
    gate.set()
    watchers[0].join(TIMEOUT)
    assert not watchers[0].is_alive()  # none left to watch: it ended
    assert sorted(map(id, called)) == sorted(map(id, futures))


def test_bridged_reads_all_settle(handle, tmp_path):
    t = torch.arange(1 << 12, dtype=torch.float32)
    handle.pwrite(t, tmp_path / "f").wait(TIMEOUT)
    outs = [torch.empty_like(t) for _ in range(200)]
    bridged = [bridge(handle.pread(o, tmp_path / "f")) for o in outs]
    done, not_done = cf.wait(bridged, timeout=TIMEOUT)
    assert not not_done and all(b.result() == t.nbytes for b in bridged)
    assert all(torch.equal(o, t) for o in outs)


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, threading.TIMEOUT_MAX * 2])
@pytest.mark.parametrize("call", ["wait", "result", "exception"])
def test_a_timeout_longer_than_the_platform_can_wait_waits_until_done(call, timeout):
    """threading's waits (an async_save's) raised OverflowError ("timestamp out of range for platform time_t") for
    timeout=float('inf'), which passed the check of the timeout and means: no limit."""
    from swapio.core.futures import Future
    gate = threading.Event()
    future = Future(GatedRequest(gate))
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    try:
        assert getattr(future, call)(timeout=timeout) == (None if call == "exception" else 7)
    finally:
        opener.cancel()
        gate.set()
