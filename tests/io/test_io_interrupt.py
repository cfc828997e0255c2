"""Ctrl-C during a wait raises KeyboardInterrupt while the request is still running, without giving up the
memory the kernel may still write into: the interrupted future (and handle) can be waited again."""
import contextlib
import signal
import threading

import pytest
import torch

import swapio
from conftest import TIMEOUT, random_bytes


@contextlib.contextmanager
def ctrl_c_until_raised():
    """Sends SIGINT to the main thread every 10 ms until one KeyboardInterrupt has been raised; later signals
    (already on their way when the first one landed) are swallowed, so none escapes the block."""
    raised = threading.Event()
    main = threading.main_thread().ident

    def interrupt_once(signum, frame):
        if not raised.is_set():
            raised.set()
            raise KeyboardInterrupt

    def send():
        while not raised.wait(0.01):
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, interrupt_once)
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        raised.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)


def slow_handle(monkeypatch):
    """Its requests finish only when the handle gives up on a reap that keeps failing (about a second)."""
    monkeypatch.setenv("SWAPIO_FAULT", "errno=reap,count=all")
    h = swapio.AioHandle(engine="psync", threads=1)
    monkeypatch.delenv("SWAPIO_FAULT")
    return h


@pytest.mark.slow
def test_ctrl_c_interrupts_future_wait_and_the_future_can_be_waited_again(monkeypatch, tmp_path):
    h = slow_handle(monkeypatch)
    data = random_bytes(1 << 20, 1)
    f = h.pwrite(data, tmp_path / "f.bin")
    with ctrl_c_until_raised(), pytest.raises(KeyboardInterrupt):
        f.wait(timeout=TIMEOUT)
    assert not f.done()  # interrupted while the request ran, not after it finished
    held, storage = f._keepalive  # the memory stays held for the kernel (the tensor and its storage)
    assert held is data and storage.data_ptr() == data.untyped_storage().data_ptr()
    with pytest.raises(OSError, match="collecting completions"):
        f.wait(timeout=TIMEOUT)
    h.close()


@pytest.mark.slow
def test_ctrl_c_interrupts_handle_wait_and_keeps_requests_tracked(monkeypatch, tmp_path):
    h = slow_handle(monkeypatch)
    data = random_bytes(1 << 20, 2)
    f = h.pwrite(data, tmp_path / "f.bin")
    del data
    with ctrl_c_until_raised(), pytest.raises(KeyboardInterrupt):
        h.wait()
    assert not f.done() and f in h._pending
    with pytest.raises(OSError, match="collecting completions"):
        h.wait()
    h.close()
