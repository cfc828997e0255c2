"""Faults injected into every engine (SWAPIO_FAULT, a testing aid): each error reaches the future of the request
it belongs to with errno, path and offset; EINTR/EAGAIN are retried a bounded number of times; a broken reap
fails the requests instead of hanging close(); the handle stays usable; nothing leaks; data written before a
fault reads back intact."""
import errno
import gc
import os
import time

import pytest
import torch

import swapio
from conftest import TIMEOUT, close_handle, engine_param, live_threads, random_bytes, read_file, unaligned_uint8

BLOCK = 64 << 10
PIECES = 16  # per request of BLOCK * PIECES bytes
ALL_ENGINES = [engine_param(e) for e in ("uring", "aio", "psync", "null")]
DISK_ENGINES = [p for p in ALL_ENGINES if p.id != "null"]


def faulty_handle(monkeypatch, engine, spec, queue_depth=4):
    """A one-worker handle (pieces are submitted in file order) with the fault spec read at creation."""
    monkeypatch.setenv("SWAPIO_FAULT", spec)
    h = swapio.AioHandle(engine=engine, block_size=BLOCK, queue_depth=queue_depth, threads=1)
    monkeypatch.delenv("SWAPIO_FAULT")
    return h


def payload(seed):
    buf = swapio.empty_pinned(BLOCK * PIECES, torch.uint8)
    buf.copy_(random_bytes(BLOCK * PIECES, seed))
    return buf


def kernel_resources():
    """Descriptors, threads, kernel I/O rings mapped in (io_uring, AIO), pinned and bounce bytes held (after a
    collection: an earlier test's buffers may wait in a reference cycle)."""
    gc.collect()
    with open("/proc/self/maps") as f:
        rings = sum("[aio]" in line or "io_uring" in line for line in f)
    held = swapio._C.held_bytes()
    return len(os.listdir("/proc/self/fd")), live_threads(), rings, held["pinned"], held["bounce"]


def assert_released(before):
    """Everything is back to `before` (a joined thread may leave /proc a moment after join() returns)."""
    deadline = time.monotonic() + TIMEOUT
    while kernel_resources() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kernel_resources() == before


@pytest.mark.slow
@pytest.mark.parametrize("err", ["EIO", "ENOSPC", "EFAULT"])
@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_injected_error_reaches_its_future(monkeypatch, tmp_path, engine, err):
    good = payload(1)
    bad = unaligned_uint8(BLOCK * PIECES, 2)  # through the bounce buffers, whose bytes must be let go too
    before = kernel_resources()
    # Pieces 1-16 write `good`; the fault hits piece 20, the 4th piece of the second request.
    h = faulty_handle(monkeypatch, engine, f"piece=20,errno={err}")
    assert h.pwrite(good, tmp_path / "good.bin").wait(timeout=TIMEOUT) == good.nbytes
    with pytest.raises(OSError) as info:
        h.pwrite(bad, tmp_path / "bad.bin", offset=BLOCK).wait(timeout=TIMEOUT)
    assert swapio._C.held_bytes()["bounce"] > before[-1]
    e = info.value
    assert e.errno == getattr(errno, err)
    assert e.filename == str(tmp_path / "bad.bin")
    assert e.offset == BLOCK + 3 * BLOCK
    # The handle stays usable, and what was written before the fault is intact.
    back = torch.empty_like(good)
    assert h.pread(back, tmp_path / "good.bin").wait(timeout=TIMEOUT) == back.nbytes
    if engine != "null":
        assert torch.equal(back, good)
        assert read_file(tmp_path / "good.bin") == good.numpy().tobytes()
    close_handle(h)
    assert_released(before)


@pytest.mark.parametrize("err", ["EINTR", "EAGAIN"])
@pytest.mark.parametrize("engine", DISK_ENGINES)
def test_transient_errors_are_retried_then_bounded(monkeypatch, tmp_path, engine, err):
    data = payload(3)
    h = faulty_handle(monkeypatch, engine, f"piece=2,errno={err},count=5")
    assert h.pwrite(data, tmp_path / "f.bin").wait(timeout=TIMEOUT) == data.nbytes  # 5 retries: invisible
    assert read_file(tmp_path / "f.bin") == data.numpy().tobytes()
    close_handle(h)

    h = faulty_handle(monkeypatch, engine, f"piece=2,errno={err},count=all", queue_depth=1)
    with pytest.raises(OSError, match="times in a row") as info:
        h.pwrite(data, tmp_path / "g.bin").wait(timeout=TIMEOUT)
    assert info.value.errno == getattr(errno, err) and info.value.offset == BLOCK
    close_handle(h)


@pytest.mark.parametrize("engine", DISK_ENGINES)
def test_short_transfers_resume_with_every_byte(monkeypatch, tmp_path, engine):
    data = payload(4)
    h = faulty_handle(monkeypatch, engine, "piece=1,errno=short,count=6")
    assert h.pwrite(data, tmp_path / "f.bin").wait(timeout=TIMEOUT) == data.nbytes
    back = torch.zeros_like(data)
    assert h.pread(back, tmp_path / "f.bin").wait(timeout=TIMEOUT) == data.nbytes
    assert torch.equal(back, data)
    assert read_file(tmp_path / "f.bin") == data.numpy().tobytes()
    close_handle(h)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ALL_ENGINES)
def test_reap_that_keeps_failing_fails_requests_and_close_returns(monkeypatch, tmp_path, engine):
    data = [payload(5) for _ in range(4)]
    before = kernel_resources()
    h = faulty_handle(monkeypatch, engine, "piece=3,errno=reap,count=all")
    futures = [h.pwrite(data[i], tmp_path / f"f{i}.bin") for i in range(3)]
    for f in futures:
        with pytest.raises(OSError) as info:
            f.wait(timeout=TIMEOUT)
        assert info.value.errno == errno.EIO
    with pytest.raises(OSError, match="make a new handle"):  # later requests fail at once, clearly
        h.pwrite(data[3], tmp_path / "later.bin").wait(timeout=TIMEOUT)
    close_handle(h)  # fails the test if it hangs
    assert_released(before)


@pytest.mark.parametrize("engine", DISK_ENGINES)
def test_reap_that_recovers_keeps_the_handle_usable(monkeypatch, tmp_path, engine):
    h = faulty_handle(monkeypatch, engine, "piece=1,errno=reap,count=3")
    first = h.pwrite(payload(7), tmp_path / "first.bin")
    with pytest.raises(OSError, match="collecting completions failed"):
        first.wait(timeout=TIMEOUT)
    data = payload(8)
    assert h.pwrite(data, tmp_path / "f.bin").wait(timeout=TIMEOUT) == data.nbytes
    assert read_file(tmp_path / "f.bin") == data.numpy().tobytes()
    close_handle(h)


@pytest.mark.parametrize("spec, problem", [("errno=EWHAT", "errno must be"), ("piece=0,errno=EIO", "piece"),
                                           ("count=2", "names no errno"), ("bogus=1,errno=EIO", "unknown key")])
def test_bad_fault_spec_is_value_error(monkeypatch, spec, problem):
    monkeypatch.setenv("SWAPIO_FAULT", spec)
    with pytest.raises(ValueError, match=problem):
        swapio.AioHandle(engine="psync")
