"""The load generator under `swapio bench` and `swapio tune`: keeps large native requests in flight on one file.

Sequential runs keep a few large requests (tens of MiB, from pinned buffers) outstanding on one AioHandle and
refill as each completes, so the workers' queues never drain between requests; random runs use the native
`submit_random`, so IOPS are not limited by Python. Latency is recorded per block-size piece in the native
core (submit to completion).
"""
import os
import resource
import time
from collections import deque

import numpy as np
import torch

from .. import _progress
from ..core.pinned import empty_pinned
from .errors import VerifyError
from .pattern import random_offsets
from .testfile import no_interrupts

OUTSTANDING = 3            # requests kept in flight by the pump
SEQ_REQUEST = 64 << 20     # bytes per sequential request (at least bs * iodepth * threads)


class Progress:
    """A tqdm bar on stderr that shows only for runs longer than ~2 s (bytes done, or seconds of a timed run).
    enabled: True, False or None (on a terminal only), by swapio._progress's rule."""

    def __init__(self, enabled, desc, total_bytes=None, seconds=None):
        self.seconds = seconds
        if seconds:
            self.bar = _progress.bar(enabled, total=round(seconds, 1), desc=desc, delay=2, leave=False,
                                     dynamic_ncols=True,
                                     bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s{postfix}")
        else:
            self.bar = _progress.bar(enabled, total=total_bytes, desc=desc, unit="B", unit_scale=True,
                                     unit_divisor=1024, delay=2, leave=False, dynamic_ncols=True)

    def update(self, nbytes, elapsed, rate=None):
        if self.bar is None:
            return
        if self.seconds:
            self.bar.n = min(round(elapsed, 1), self.bar.total)
            if rate:
                self.bar.set_postfix_str(f"{rate / (1 << 20):.0f} MiB/s", refresh=False)
            self.bar.refresh()
        else:
            self.bar.update(nbytes)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _cpu_seconds():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def pump(submit, *, count=None, runtime=None, warmup=0.0, outstanding=OUTSTANDING, progress=None,
          record=True):
    """Keeps up to `outstanding` requests in flight, submitting the next as the oldest completes.

    submit(k, m) -> (native request, bytes, pieces, on_done or None); k counts every request, m the measured
    ones (None during the warmup). Size-based: `count` measured requests;
    time-based: measured requests are submitted until `runtime` seconds after the warmup. Requests submitted
    during the warmup are not counted; the measured window opens when the last of them completes.
    Returns (bytes, pieces, seconds, latencies (uint64 ns), usr %, sys %).
    """
    inflight = deque()
    t0 = time.perf_counter()
    warm_end = t0 + warmup
    deadline = warm_end + runtime if runtime else None
    win_start = t0 if not warmup else None
    cpu0 = _cpu_seconds()
    k = counted = 0
    nbytes = nios = 0
    lats = []

    def more(now):
        if warmup and now < warm_end:
            return True, False
        if deadline is not None:
            return now < deadline, True
        return counted < count, True

    try:
        while True:
            now = time.perf_counter()
            while len(inflight) < outstanding:
                go, measured = more(now)
                if not go:
                    break
                req, b, n, on_done = submit(k, counted if measured else None)
                inflight.append((req, b, n, on_done, measured))
                k += 1
                counted += measured
            if not inflight:
                break
            req, b, n, on_done, measured = inflight[0]
            while not req.wait(0.1):
                if progress is not None and deadline is not None:
                    progress.update(0, time.perf_counter() - t0)
            inflight.popleft()
            req.result()  # OSError on failure
            if on_done is not None:
                on_done()
            now = time.perf_counter()
            if measured:
                nbytes += b
                nios += n
                if record:
                    lats.append(req.latencies_ns())
            elif not inflight or inflight[0][4]:
                win_start = now  # the last warmup request is done: the window opens
                if runtime:  # and lasts `runtime` seconds however long the warmup's tail took (fio's ramp_time)
                    deadline = max(deadline, win_start + runtime)
                cpu0 = _cpu_seconds()
            if progress is not None:
                rate = nbytes / (now - win_start) if win_start is not None and now > win_start else None
                progress.update(b if measured else 0, now - t0, rate)
    except BaseException:
        # The requests still in flight use buffers the caller is about to drop: let them finish first.
        with no_interrupts():
            for entry in inflight:
                entry[0].wait()
        raise
    end = time.perf_counter()
    cpu1 = _cpu_seconds()
    if win_start is None:  # nothing was measured (the warmup outlasted a size-based run)
        win_start = end
    seconds = max(end - win_start, 1e-9)
    lat = np.frombuffer(b"".join(lats), dtype=np.uint64) if lats else np.zeros(0, np.uint64)
    return (nbytes, nios, seconds, lat, 100.0 * (cpu1[0] - cpu0[0]) / seconds,
            100.0 * (cpu1[1] - cpu0[1]) / seconds)


def _u64(tensor):
    return tensor.numpy().view(np.uint64)


def sequential_submitter(handle, direction, path, size, chunk, buffers, pattern, record=True):
    """submit(k) for a sequential pass cycling over [0, size) in `chunk`-byte requests."""
    nchunks = -(-size // chunk)
    native = handle._native

    def submit(k, m):
        pos = (k % nchunks) * chunk
        length = min(chunk, size - pos)
        buf = buffers[k % len(buffers)]
        on_done = None
        if pattern is not None and direction == "write":
            pattern.fill(_u64(buf)[: length // 8], pos)
        elif pattern is not None:
            def on_done(buf=buf, pos=pos, length=length):
                bad = pattern.first_mismatch(_u64(buf)[: length // 8], pos)
                if bad is not None:
                    raise VerifyError(path, bad)
        req = native.submit(direction, buf.data_ptr(), length, path, pos, record)
        return req, length, -(-length // handle.block_size), on_done

    return submit


def random_submitter(handle, direction, path, size, per_request, buffers, pattern, total=None):
    """submit(k) for random pieces: `per_request` pieces per request (the last one fewer when `total` is set)."""
    bs = handle.block_size
    native = handle._native

    def submit(k, m):
        n = per_request if total is None or m is None else min(per_request, total - m * per_request)
        seed = k * per_request
        buf = buffers[k % len(buffers)]
        on_done = None
        if pattern is not None:
            offsets = random_offsets(seed, n, size, bs)
            if direction == "write":
                pattern.fill_pieces(_u64(buf), offsets, bs)
            else:
                def on_done(buf=buf, offsets=offsets):
                    bad = pattern.first_mismatch_pieces(_u64(buf), offsets, bs)
                    if bad is not None:
                        raise VerifyError(path, bad)
        req = native.submit_random(direction, buf.data_ptr(), buf.numel(), path, size, n, seed, True)
        return req, n * bs, n, on_done

    return submit


def pinned_buffer(nbytes, fill_random):
    """A pinned uint8 buffer; fill_random: random bytes, like fio."""
    buf = empty_pinned(nbytes, dtype=torch.uint8)
    if fill_random:  # like fio: random bytes, so compressing or deduplicating storage gains nothing
        g = torch.Generator().manual_seed(0x5A17)
        buf.view(torch.int32).random_(generator=g) if nbytes % 4 == 0 else buf.random_(0, 256, generator=g)
    return buf


def drop_cache(path):
    """Like fio's invalidate=1: drop the file's pages from the page cache before a phase."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def sequential_pass(handle, direction, path, size, pattern, progress, desc):
    """An unmeasured full pass (layout or verify) with 1 MiB pieces."""
    chunk = min(SEQ_REQUEST, size)
    if direction == "write" and pattern is None:
        buffers = [pinned_buffer(chunk, True)]
    else:
        buffers = [pinned_buffer(chunk, False) for _ in range(OUTSTANDING)]
    submit = sequential_submitter(handle, direction, path, size, chunk, buffers, pattern, record=False)
    bar = Progress(progress, desc, total_bytes=size)
    try:
        pump(submit, count=-(-size // chunk), progress=bar, record=False)
    finally:
        bar.close()
