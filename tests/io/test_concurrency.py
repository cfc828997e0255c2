"""Many requests at once: several handles and Python threads, dropped futures, handles closed with requests
outstanding, futures outliving their handle, and AioHandle.wait() accounting."""
import errno
import gc
import os
import random
import threading
import time
import weakref

import pytest
import torch

import swapio
from conftest import (ENGINES, TIMEOUT, as_bytes, close_handle, open_fds, random_bytes, read_file,
                      wait_handle)


def usable_engines():
    status = swapio.info()["engines"]
    return [e for e in ENGINES if status[e] == "ok"] or ["psync"]


@pytest.mark.slow
def test_256_futures_in_flight_across_4_handles_and_8_threads(tmp_path):
    engines = usable_engines()
    handles = [swapio.AioHandle(engine=engines[i % len(engines)], block_size=4096, queue_depth=16,
                                threads=1 + i % 2) for i in range(4)]
    n_threads, per_thread = 8, 40  # 320 writes, then 320 reads, all submitted before any is waited on
    jobs = []  # (path, offset, source tensor)
    for k in range(n_threads * per_thread):
        size = [1, 511, 4096, 4097, 20000, 65536 + 3][k % 6]
        jobs.append((tmp_path / f"f{k % 37}.bin", (k // 37) * 70000 + (k % 3), random_bytes(size, seed=k)))
    write_futures, errors = [None] * len(jobs), []
    start = threading.Barrier(n_threads)
    # Descriptors opened before the writes: fsync on them reports EIO if the kernel saw an O_DIRECT write
    # collide with buffered I/O on the same page ("Page cache invalidation failure on direct I/O").
    watch = {p: os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in {path for path, _, _ in jobs}}

    def submit_writes(t):
        rng = random.Random(t)
        start.wait(timeout=TIMEOUT)
        try:
            for k in range(t, len(jobs), n_threads):
                path, off, src = jobs[k]
                write_futures[k] = rng.choice(handles).pwrite(src, path, off)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=submit_writes, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and all(f is not None for f in write_futures)
    assert len(write_futures) >= 256
    for k, f in enumerate(write_futures):
        assert f.wait(timeout=TIMEOUT) == jobs[k][2].numel()
    collided = []
    for p, fd in watch.items():
        try:
            os.fsync(fd)
        except OSError as exc:
            collided.append((p.name, exc.errno))
        os.close(fd)
    assert not collided, "kernel reported stale page cache after O_DIRECT writes (buffered/direct collision)"

    # Every range holds its bytes (checked with plain reads) ...
    contents = {}
    for path, off, src in jobs:
        data = contents.setdefault(path, read_file(path))
        assert data[off:off + src.numel()] == as_bytes(src)
    # ... and reads, submitted concurrently from several threads too, bring them back.
    outs = [torch.empty_like(src) for _, _, src in jobs]
    read_futures = [None] * len(jobs)

    def submit_reads(t):
        for k in range(t, len(jobs), n_threads):
            path, off, _ = jobs[k]
            read_futures[k] = handles[k % 4].pread(outs[k], path, off)

    threads = [threading.Thread(target=submit_reads, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for k, f in enumerate(read_futures):
        assert f.wait(timeout=TIMEOUT) == jobs[k][2].numel()
        assert torch.equal(outs[k], jobs[k][2])
    for h in handles:
        close_handle(h)


@pytest.mark.slow
@pytest.mark.parametrize("engine", usable_engines())
def test_1000_dropped_futures_write_correctly_and_release_everything(tmp_path, engine):
    h = swapio.AioHandle(engine=engine, block_size=4096, queue_depth=32)
    path = tmp_path / "dropped.bin"
    fds_before = open_fds()
    refs = []
    for i in range(1000):
        src = random_bytes(1000 + (i % 7), seed=i)
        refs.append(weakref.ref(src))
        h.pwrite(src, path, i * 1024)  # the future is dropped at once
        del src
    wait_handle(h)
    gc.collect()
    data = read_file(path)
    for i in range(1000):
        n = 1000 + (i % 7)
        assert data[i * 1024:i * 1024 + n] == as_bytes(random_bytes(n, seed=i)), f"piece {i}"
    # No leak: the handle let go of every source tensor and every file descriptor.
    assert sum(r() is not None for r in refs) == 0
    assert open_fds() <= fds_before
    close_handle(h)


def test_dropped_futures_do_not_pile_up_in_the_handle(handle_factory, tmp_path):
    """Finished futures that nobody waited for are pruned as new requests come in."""
    h = handle_factory(engine="null")
    src = random_bytes(64)
    for i in range(1000):
        h.pwrite(src, tmp_path / "n.bin")
        if i % 50 == 49:  # let the worker catch up (a loaded machine runs it late): what is done must then go
            deadline = time.monotonic() + TIMEOUT
            while not all(f.done() for f in list(h._pending)) and time.monotonic() < deadline:
                time.sleep(0.001)
    gc.collect()
    assert len(h._pending) < 100
    assert wait_handle(h) == 64 * 1000


def test_closing_handle_with_outstanding_requests_finishes_them(tmp_path):
    h = swapio.AioHandle(block_size=4096, queue_depth=4)
    sources = [random_bytes(256 * 1024, seed=i) for i in range(8)]
    futures = [h.pwrite(src, tmp_path / f"c{i}.bin") for i, src in enumerate(sources)]
    close_handle(h)  # returns only once every queued request is done
    assert h.closed
    assert all(f.done() for f in futures)
    for i, (f, src) in enumerate(zip(futures, sources)):
        assert f.wait(timeout=TIMEOUT) == src.numel()
        assert read_file(tmp_path / f"c{i}.bin") == as_bytes(src)


def test_future_outlives_its_deleted_handle(tmp_path):
    h = swapio.AioHandle(block_size=4096, queue_depth=2)
    src = random_bytes(512 * 1024, seed=5)
    f = h.pwrite(src, tmp_path / "o.bin")
    del h, src
    gc.collect()
    assert f.wait(timeout=TIMEOUT) == 512 * 1024
    assert read_file(tmp_path / "o.bin") == as_bytes(random_bytes(512 * 1024, seed=5))


def test_failed_future_outlives_its_deleted_handle(tmp_path):
    h = swapio.AioHandle()
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    f = h.pread(torch.empty(200, dtype=torch.uint8), path)
    del h
    gc.collect()
    with pytest.raises(OSError) as e:
        f.wait(timeout=TIMEOUT)
    assert e.value.errno == errno.ENODATA


def test_handle_wait_returns_total_bytes_of_all_outstanding(handle_factory, tmp_path):
    h = handle_factory(block_size=4096)
    sizes = [1, 4096, 10000, 65537]
    for i, n in enumerate(sizes):
        h.pwrite(random_bytes(n, seed=i), tmp_path / f"w{i}.bin")
    assert wait_handle(h) == sum(sizes)
    assert wait_handle(h) == 0  # nothing outstanding any more


def test_handle_wait_counts_requests_already_waited_on_individually(handle_factory, tmp_path):
    h = handle_factory()
    f = h.pwrite(random_bytes(1000), tmp_path / "a.bin")
    assert f.wait(timeout=TIMEOUT) == 1000
    h.pwrite(random_bytes(24), tmp_path / "b.bin")
    assert wait_handle(h) == 1024


def test_handle_wait_raises_first_unobserved_error(handle_factory, tmp_path):
    h = handle_factory()
    path = tmp_path / "small.bin"
    path.write_bytes(b"y" * 10)
    h.pwrite(random_bytes(100), tmp_path / "ok.bin")
    h.pread(torch.empty(100, dtype=torch.uint8), path)  # past the end: ENODATA, dropped
    with pytest.raises(OSError) as e:
        wait_handle(h)
    assert e.value.errno == errno.ENODATA
    assert e.value.filename == str(path)
    assert wait_handle(h) == 0  # the error is reported once


def test_handle_wait_does_not_reraise_error_its_future_raised(handle_factory, tmp_path):
    h = handle_factory()
    path = tmp_path / "small.bin"
    path.write_bytes(b"y" * 10)
    f = h.pread(torch.empty(100, dtype=torch.uint8), path)
    with pytest.raises(OSError):
        f.wait(timeout=TIMEOUT)
    h.pwrite(random_bytes(7), tmp_path / "ok.bin")
    assert wait_handle(h) == 7


def test_concurrent_writers_to_one_handle_from_threads_interleave_safely(handle_factory, tmp_path):
    """Threads share one handle and one file, each writing its own region; the regions stay separate."""
    h = handle_factory(block_size=4096, threads=2)
    path = tmp_path / "shared.bin"
    region, n_threads, rounds = 12289, 6, 10
    results, errors = {}, []

    def writer(t):
        try:
            for r in range(rounds):
                src = random_bytes(region, seed=t * 100 + r)
                off = (t * rounds + r) * region
                results[(t, r)] = (off, src, h.pwrite(src, path, off))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors
    for off, src, f in results.values():
        assert f.wait(timeout=TIMEOUT) == region
    data = read_file(path)
    assert len(data) == n_threads * rounds * region
    for off, src, _ in results.values():
        assert data[off:off + region] == as_bytes(src)


@pytest.mark.parametrize("engine", usable_engines())
@pytest.mark.parametrize("chunk", [5000, 12345], ids=lambda c: f"chunk{c}")
def test_adjacent_unaligned_chunks_written_concurrently_to_one_file_all_land(tmp_path, engine, chunk):
    """Like an optimizer writing state chunks of a flat buffer: neighbours share pages, so one request's
    buffered edge and another's O_DIRECT middle meet in the same page while both are in flight."""
    h = swapio.AioHandle(engine=engine, block_size=1 << 20, queue_depth=64, threads=2)
    path = tmp_path / "flat.bin"
    watch = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    src = random_bytes(64 * chunk, seed=chunk)
    futures = [h.pwrite(src[i * chunk:(i + 1) * chunk], path, i * chunk) for i in range(64)]
    for f in futures:
        assert f.wait(timeout=TIMEOUT) == chunk
    try:
        os.fsync(watch)  # EIO here: the kernel saw O_DIRECT collide with buffered I/O (stale page cache)
    finally:
        os.close(watch)
        close_handle(h)
    assert read_file(path) == as_bytes(src)
    out = torch.empty_like(src)
    with swapio.AioHandle(engine=engine) as reader:
        assert reader.pread(out, path).wait(timeout=TIMEOUT) == src.numel()
    assert torch.equal(out, src)


def test_pinned_buffers_freed_after_dropped_futures_settle(tmp_path):
    """A dropped future keeps its pinned source alive only until the I/O is done and accounted for."""
    h = swapio.AioHandle()
    before = len(swapio.core.pinned._ends)
    for i in range(20):
        buf = swapio.empty_pinned((8192,), torch.uint8)
        buf.copy_(random_bytes(8192, seed=i))
        h.pwrite(buf, tmp_path / f"p{i}.bin")
        del buf
    wait_handle(h)
    close_handle(h)
    gc.collect()
    assert len(swapio.core.pinned._ends) == before
    assert read_file(tmp_path / "p19.bin") == as_bytes(random_bytes(8192, seed=19))
    assert os.path.getsize(tmp_path / "p0.bin") == 8192
