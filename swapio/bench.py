"""`swapio bench`: fio-style bandwidth, IOPS, latency and CPU use of swapio's native I/O path on one file.

Sequential phases keep a few large requests (tens of MiB, from one pinned buffer) outstanding on one
AioHandle and refill as each completes, so the workers' queues never drain between requests; random phases
use the native `submit_random`, so IOPS are not limited by Python. Latency is recorded per block-size piece
in the native core (submit to completion). `run_bench(BenchConfig(...))` is the library entry point; the
command line is in swapio.cli.
"""
import contextlib
import dataclasses
import os
import resource
import signal
import tempfile
import threading
import time
from collections import deque

import numpy as np
import torch

from . import __version__, _C
from . import fiocompare
from . import report
from .handle import AioHandle
from .pinned import empty_pinned

RW_PHASES = {  # --rw -> phases in order: (label, direction, random)
    "read": [("read", "read", False)],
    "write": [("write", "write", False)],
    "randread": [("randread", "read", True)],
    "randwrite": [("randwrite", "write", True)],
    "rw": [("write", "write", False), ("read", "read", False)],
}
DESCRIPTIONS = {"read": "sequential read", "write": "sequential write", "randread": "random read",
                "randwrite": "random write", "rw": "sequential write then read"}
ENGINES = ("auto", "uring", "aio", "psync", "null")
TEMP_PREFIX = "swapio-bench-"

_OUTSTANDING = 3          # requests kept in flight by the pump
_SEQ_REQUEST = 64 << 20   # bytes per sequential request (at least bs * iodepth * threads)
_RAND_REQUEST = 16 << 20  # bytes per random request (count = this / bs, clamped)
_LAYOUT_BLOCK = 1 << 20


class BenchError(Exception):
    """A problem with the user's input or environment: printed as one line by the CLI."""


class VerifyError(BenchError):
    """--verify found bytes that differ from what was written; `.offset` is the first bad byte's file offset."""

    def __init__(self, path, offset):
        super().__init__(f"verify failed: {path} holds unexpected data at offset {offset}")
        self.path, self.offset = path, offset


@dataclasses.dataclass
class BenchConfig:
    rw: str = "rw"
    bs: int = 1 << 20
    iodepth: int = 32
    threads: int = 1
    size: int = 1 << 30
    engine: str = "auto"
    direct: bool = None        # None: O_DIRECT where the file system takes it; True: required; False: buffered
    file: str = None           # a named file (kept afterwards, like fio), or
    directory: str = None      # a temporary file in this directory (default: the working directory), removed
    runtime: float = None      # seconds, time-based; else `loops` passes over the file
    loops: int = 1
    warmup: float = 0.0        # seconds of I/O before measuring (fio's ramp_time)
    verify: bool = False
    compare_fio: bool = False
    fio_first: bool = False    # with compare_fio: fio's phases before swapio's (alternate to cancel drift)
    progress: bool = False

    def validate(self):
        if self.rw not in RW_PHASES:
            raise BenchError(f"--rw must be one of {', '.join(RW_PHASES)}, got {self.rw!r}")
        if self.engine not in ENGINES:
            raise BenchError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for name, value, lo, hi in (("--bs", self.bs, 1, 1 << 30), ("--iodepth", self.iodepth, 1, 4096),
                                    ("--threads", self.threads, 1, 256), ("--loops", self.loops, 1, None)):
            if value < lo or (hi is not None and value > hi):
                raise BenchError(f"{name} must be between {lo} and {hi}, got {value}" if hi else
                                 f"{name} must be at least {lo}, got {value}")
        if self.size < self.bs:
            raise BenchError(f"--size ({self.size}) must be at least --bs ({self.bs})")
        if self.size % self.bs:
            raise BenchError(f"--size ({report.fmt_size(self.size)}) must be a multiple of --bs "
                             f"({report.fmt_size(self.bs)})")
        if self.size // self.bs < self.threads:
            raise BenchError(f"--size holds {self.size // self.bs} blocks, fewer than --threads ({self.threads})")
        if self.runtime is not None and not self.runtime > 0:
            raise BenchError(f"--runtime must be > 0, got {self.runtime}")
        if not self.warmup >= 0:
            raise BenchError(f"--warmup must be >= 0, got {self.warmup}")
        if self.verify and self.bs % 8:
            raise BenchError(f"--verify needs --bs a multiple of 8, got {self.bs}")
        if self.file is not None and self.directory is not None:
            raise BenchError("give --file or --dir, not both")
        if self.fio_first and not self.compare_fio:
            raise BenchError("--fio-first needs --compare-fio")
        if self.fio_first and self.verify:
            raise BenchError("--fio-first and --verify don't mix (fio's writes would replace the pattern)")
        if self.verify and self.engine == "null":
            raise BenchError("--verify needs a real engine (null moves no data)")
        if self.compare_fio and self.engine == "null":
            raise BenchError("--compare-fio needs a real engine (not null)")


@dataclasses.dataclass
class Phase:
    label: str          # write, read, randread, randwrite
    direction: str      # read or write
    bytes: int
    ios: int
    elapsed: float      # seconds of the measured window
    lat_ns: np.ndarray  # one latency per block-size piece
    usr_cpu: float      # % of one core
    sys_cpu: float


@dataclasses.dataclass
class BenchResult:
    config: BenchConfig
    path: str
    temporary: bool
    engine: str
    direct: bool
    phases: list
    verify: str = None
    fio: dict = None
    started: float = dataclasses.field(default_factory=time.time)

    def phase(self, label):
        return next(p for p in self.phases if p.label == label)

    def json(self):
        """fio-shaped: jobs[0].read / jobs[0].write with bw_bytes, bw (KiB/s), iops, runtime (ms), clat_ns and
        lat_ns (min, max, mean, stddev, N, percentile{"99.000000": ns, ...}); plus jobs[0].swapio (settings as
        run) and, with --compare-fio, a top-level "fio" block with fio's figures and the ratios."""
        c = self.config
        by_dir = {p.direction: p for p in self.phases}
        elapsed = sum(p.elapsed for p in self.phases)
        cpu = lambda attr: (sum(getattr(p, attr) * p.elapsed for p in self.phases) / elapsed if elapsed else 0.0)
        limit = (f"time-based {c.runtime:g} s" if c.runtime else f"{c.loops} loop" + ("s" if c.loops > 1 else ""))
        if c.warmup:
            limit += f" after {c.warmup:g} s warmup"
        options = {"rw": c.rw, "bs": str(c.bs), "iodepth": str(c.iodepth), "numjobs": str(c.threads),
                   "size": str(c.size), "ioengine": self.engine, "direct": str(int(self.direct)),
                   "filename": self.path}
        if c.runtime:
            options.update(time_based="1", runtime=f"{c.runtime:g}")
        else:
            options["loops"] = str(c.loops)
        if c.warmup:
            options["ramp_time"] = f"{c.warmup:g}"
        if c.verify:
            options["verify"] = "pattern"
        job = {
            "jobname": "swapio", "groupid": 0, "error": 0, "elapsed": int(round(elapsed)),
            "job options": options,
            "read": report.direction_json(by_dir.get("read")),
            "write": report.direction_json(by_dir.get("write")),
            "job_runtime": int(round(elapsed * 1000)),
            "usr_cpu": cpu("usr_cpu"), "sys_cpu": cpu("sys_cpu"),
            "swapio": {"engine": self.engine, "direct": self.direct, "filename": self.path,
                       "temporary": self.temporary, "size": c.size, "bs": c.bs, "iodepth": c.iodepth,
                       "threads": c.threads, "rw": c.rw, "description": DESCRIPTIONS[c.rw], "limit": limit,
                       "phases": [f"{p.label}:{p.direction}" for p in self.phases], "verify": self.verify,
                       "latency": "per block-size piece, submit to completion, in the native core"},
        }
        doc = {"swapio version": __version__, "timestamp": int(self.started),
               "timestamp_ms": int(self.started * 1000), "time": time.ctime(self.started),
               "global options": {}, "jobs": [job]}
        if self.fio is not None:
            doc["fio"] = self.fio
            ratios = {}
            for label, key, _, ours, theirs, _ in report.compare_rows(doc):
                r = ours / theirs if theirs else float("nan")
                ratios.setdefault(label, {})[key] = r if np.isfinite(r) else None
            doc["fio"]["ratios"] = ratios
        return doc


# --- data pattern for --verify: the 8-byte word at file offset 8*w holds w*K + C (mod 2^64), so a block read
# from the wrong offset, a torn write or a flipped bit all show.
_K = np.uint64(0x9E3779B97F4A7C15)
_C0 = np.uint64(0x5A17B0C55A17B0C5)


class _Pattern:
    def __init__(self, nbytes):
        with np.errstate(over="ignore"):
            self.base = np.arange(nbytes // 8, dtype=np.uint64) * _K + _C0
        self.scratch = np.empty(min(self.base.size, 1 << 17), dtype=np.uint64)

    @staticmethod
    def _shift(offset):
        return np.uint64(((offset // 8) * int(_K)) % (1 << 64))

    def fill(self, words, offset):
        n = words.size
        with np.errstate(over="ignore"):
            np.add(self.base[:n], self._shift(offset), out=words)

    def first_mismatch(self, words, offset):
        """Offset of the first wrong byte in `words` (read from file offset `offset`), or None."""
        step = 1 << 17  # compare 1 MiB at a time: small temporaries, no page faults
        for a in range(0, words.size, step):
            got = words[a:a + step]
            want = self.scratch[:got.size]
            with np.errstate(over="ignore"):
                np.add(self.base[a:a + got.size], self._shift(offset), out=want)
            if not np.array_equal(got, want):
                w = int(np.flatnonzero(got != want)[0])
                diff = (int(got[w]) ^ int(want[w])).to_bytes(8, "little")
                return offset + 8 * (a + w) + next(i for i, b in enumerate(diff) if b)
        return None

    def fill_pieces(self, words, offsets, bs):
        wpp = bs // 8
        with np.errstate(over="ignore"):
            shift = (offsets // np.uint64(8)) * _K
            np.add(self.base[None, :wpp], shift[:, None], out=words.reshape(-1, wpp)[:offsets.size])

    def first_mismatch_pieces(self, words, offsets, bs):
        wpp = bs // 8
        got = words.reshape(-1, wpp)[:offsets.size]
        with np.errstate(over="ignore"):
            want = self.base[None, :wpp] + ((offsets // np.uint64(8)) * _K)[:, None]
        bad = np.flatnonzero((got != want).any(axis=1))
        if bad.size == 0:
            return None
        j = int(bad[0])
        return int(offsets[j]) + 8 * int(np.flatnonzero(got[j] != want[j])[0])


def _splitmix64(x):
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def random_offsets(seed, count, span, bs):
    """The file offsets the native submit_random(seed, count) visits, piece i going to slot i % slots.
    Mirrors csrc/io/worker.cpp (splitmix64(seed + i) % (span / bs) * bs); tests check the two agree."""
    idx = np.arange(count, dtype=np.uint64) + np.uint64(seed)
    return _splitmix64(idx) % np.uint64(span // bs) * np.uint64(bs)


# --- progress bar (tqdm, on stderr, only for runs longer than ~2 s)
class _Progress:
    def __init__(self, enabled, desc, total_bytes=None, seconds=None):
        self.bar, self.seconds = None, seconds
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if seconds:
            self.bar = tqdm(total=round(seconds, 1), desc=desc, delay=2, leave=False, dynamic_ncols=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s{postfix}")
        else:
            self.bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                            delay=2, leave=False, dynamic_ncols=True)

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


def _pump(submit, *, count=None, runtime=None, warmup=0.0, outstanding=_OUTSTANDING, progress=None,
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
                cpu0 = _cpu_seconds()
            if progress is not None:
                rate = nbytes / (now - win_start) if win_start is not None and now > win_start else None
                progress.update(b if measured else 0, now - t0, rate)
    except BaseException:
        # The requests still in flight use buffers the caller is about to drop: let them finish first.
        with _no_interrupts():
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


def _sequential_submitter(handle, direction, path, size, chunk, buffers, pattern, record=True):
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


def _random_submitter(handle, direction, path, size, per_request, buffers, pattern, total=None):
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


def _pinned(nbytes, fill_random):
    buf = empty_pinned(nbytes, dtype=torch.uint8)
    if fill_random:  # like fio: random bytes, so compressing or deduplicating storage gains nothing
        g = torch.Generator().manual_seed(0x5A17)
        buf.view(torch.int32).random_(generator=g) if nbytes % 4 == 0 else buf.random_(0, 256, generator=g)
    return buf


def _seq_chunk(cfg, size):
    chunk = max(_SEQ_REQUEST, cfg.bs * cfg.iodepth * cfg.threads)
    chunk = chunk // cfg.bs * cfg.bs
    return min(chunk, size)


def _drop_cache(path):
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


def run_phase(handle, path, cfg, label, direction, random, *, pattern=None, progress=False):
    """One measured phase on `path` with `handle`; returns a Phase."""
    size = cfg.size
    _drop_cache(path)
    if random:
        # enough pieces per request to fill every queue, ~16 MiB when pieces are small
        per_request = max(cfg.iodepth * cfg.threads, min(1 << 16, _RAND_REQUEST // cfg.bs))
        total = None if cfg.runtime else cfg.loops * (size // cfg.bs)
        if total is not None:
            per_request = min(per_request, total)
        if pattern is not None:  # every piece its own slot: the bytes can be checked after the request
            buffers = [_pinned(per_request * cfg.bs, False) for _ in range(_OUTSTANDING)]
        else:
            slots = max(1, min(per_request, cfg.iodepth * cfg.threads))
            buffers = [_pinned(slots * cfg.bs, direction == "write")]
        submit = _random_submitter(handle, direction, path, size, per_request, buffers, pattern, total)
        count = None if total is None else -(-total // per_request)
    else:
        chunk = _seq_chunk(cfg, size)
        if pattern is not None:
            buffers = [_pinned(chunk, False) for _ in range(_OUTSTANDING)]
        else:  # the outstanding requests share one buffer: fio's memory use, not its contents, matters here
            buffers = [_pinned(chunk, direction == "write")]
        submit = _sequential_submitter(handle, direction, path, size, chunk, buffers, pattern)
        count = None if cfg.runtime else cfg.loops * (-(-size // chunk))
    bar = _Progress(progress, label, total_bytes=None if cfg.runtime else cfg.loops * size,
                    seconds=(cfg.runtime + cfg.warmup) if cfg.runtime else None)
    try:
        nbytes, nios, seconds, lat, usr, sys_ = _pump(submit, count=count, runtime=cfg.runtime,
                                                      warmup=cfg.warmup, progress=bar)
    finally:
        bar.close()
    return Phase(label, direction, nbytes, nios, seconds, lat, usr, sys_)


def _sequential_pass(handle, direction, path, size, pattern, progress, desc):
    """An unmeasured full pass (layout or verify) with 1 MiB pieces."""
    chunk = min(_SEQ_REQUEST, size)
    if direction == "write" and pattern is None:
        buffers = [_pinned(chunk, True)]
    else:
        buffers = [_pinned(chunk, False) for _ in range(_OUTSTANDING)]
    submit = _sequential_submitter(handle, direction, path, size, chunk, buffers, pattern, record=False)
    bar = _Progress(progress, desc, total_bytes=size)
    try:
        _pump(submit, count=-(-size // chunk), progress=bar, record=False)
    finally:
        bar.close()


def _layout_handle(cfg, engine, direct):
    return AioHandle(block_size=max(_LAYOUT_BLOCK, cfg.bs), queue_depth=32, threads=1, engine=engine, direct=direct)


def verify_file(path, size, *, engine="auto", direct=None, progress=False):
    """Reads [0, size) of `path` and checks it holds the --verify pattern; raises VerifyError at the first
    wrong byte. (The read-verify pass of `swapio bench --verify`, exposed for tests and scripts.)"""
    if size % 8:
        raise BenchError(f"verify size must be a multiple of 8, got {size}")
    with AioHandle(block_size=_LAYOUT_BLOCK, queue_depth=32, threads=1, engine=engine, direct=direct) as h:
        pattern = _Pattern(min(_SEQ_REQUEST, size))
        _sequential_pass(h, "read", path, size, pattern, progress, "verify")


# --- the target file and its cleanup
class _Target:
    """The file a run works on: a temporary file (always removed), or --file (removed only if this run
    created it and then failed)."""

    def __init__(self, cfg):
        self.temporary = cfg.file is None
        self.created = False
        self.path = None
        if self.temporary:
            directory = os.path.abspath(cfg.directory or os.getcwd())
            _check_directory(directory, "--dir" if cfg.directory else "working directory")
            fd, self.path = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".tmp", dir=directory)
            os.close(fd)
            self.created = True
        else:
            self.path = os.path.abspath(cfg.file)
            _check_directory(os.path.dirname(self.path), "--file's directory")
            if os.path.exists(self.path):
                if not os.path.isfile(self.path):
                    raise BenchError(f"--file {cfg.file} exists and is not a regular file")
            else:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.close(fd)
                self.created = True
        self.directory = os.path.dirname(self.path)

    def current_size(self):
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def finish(self, failed):
        if self.path and (self.temporary or (failed and self.created)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _check_directory(directory, what):
    if not os.path.exists(directory):
        raise BenchError(f"{what} {directory} does not exist")
    if not os.path.isdir(directory):
        raise BenchError(f"{what} {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BenchError(f"{what} {directory} is not writable")


@contextlib.contextmanager
def _no_interrupts():
    """Cleanup must finish: hold off SIGINT while the I/O drains and the file goes (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _free_space_check(target, cfg, writes):
    if not writes:
        return
    need = cfg.size if target.created else max(0, cfg.size - target.current_size())
    st = os.statvfs(target.directory)
    avail = st.f_bavail * st.f_frsize
    if need > avail:
        raise BenchError(f"not enough free space in {target.directory}: the run needs {report.fmt_bytes(need)}, "
                         f"{report.fmt_bytes(avail)} available (use a smaller --size)")


def _resolve_direct(target, cfg):
    probe = _C.probe_file(target.path)
    if cfg.direct is False:
        return False, probe
    if not probe["direct"]:
        if cfg.direct:
            raise BenchError(f"the file system of {target.directory} refuses O_DIRECT; use --buffered")
        return False, probe
    align = probe["offset_align"]
    if cfg.bs % align:
        raise BenchError(f"--bs {cfg.bs} is not a multiple of the direct-I/O alignment ({align} bytes) of "
                         f"{target.directory}; use a multiple of {align} or --buffered")
    return True, probe


def run_bench(cfg, *, after_phase=None, log=None):
    """Runs a benchmark; returns a BenchResult. Raises BenchError (bad input, VerifyError), OSError (I/O) or
    fiocompare.FioError; the temporary file is removed whatever happens, Ctrl-C included.

    after_phase(label, path) runs after each measured phase (tests corrupt the file there).
    log(message) receives notes (e.g. the buffered fallback)."""
    cfg.validate()
    phases_spec = RW_PHASES[cfg.rw]
    writes = any(d == "write" for _, d, _ in phases_spec)
    fio = fiocompare.find_fio() if cfg.compare_fio else None
    target = _Target(cfg)
    handle = layout = None
    failed = True
    try:
        direct, _ = _resolve_direct(target, cfg)
        if cfg.direct is None and not direct and log:
            log(f"the file system of {target.directory} refuses O_DIRECT: running buffered")
        reads_first = phases_spec[0][1] == "read"
        have = target.current_size()
        if not target.created and reads_first and have < cfg.size:
            raise BenchError(f"--file {cfg.file} holds {have} bytes, fewer than --size {cfg.size}; use a "
                             "smaller --size, or a write run first")
        # A new file is written out before the measured phases when they read it, when random writes with
        # --verify need the pattern everywhere, and for --compare-fio (fio then runs on the same, written file).
        needs_layout = target.created and (reads_first or cfg.compare_fio or (cfg.verify and cfg.rw == "randwrite"))
        _free_space_check(target, cfg, writes or needs_layout)
        try:
            handle = AioHandle(cfg.bs, cfg.iodepth, cfg.threads, cfg.engine, direct)
        except OSError as e:
            raise BenchError(f"engine {cfg.engine}: {e.strerror or e}") from None
        pattern = _Pattern(max(_seq_chunk(cfg, cfg.size), min(_SEQ_REQUEST, cfg.size))) if cfg.verify else None
        if target.created and writes and not needs_layout:
            with contextlib.suppress(OSError):  # like fio's fallocate=native: the writes then overwrite
                fd = os.open(target.path, os.O_WRONLY)
                try:
                    os.posix_fallocate(fd, 0, cfg.size)
                finally:
                    os.close(fd)
        if needs_layout:
            layout = _layout_handle(cfg, handle.engine, direct)
            _sequential_pass(layout, "write", target.path, cfg.size, pattern, cfg.progress, "laying out")
        result = BenchResult(cfg, target.path, target.temporary, handle.engine, direct, [])
        if fio is not None:
            result.fio = {"version": fiocompare.fio_version(fio), "commands": [], "phases": {}}
            if cfg.fio_first:
                _compare_fio(fio, result, cfg, log)
        for label, direction, random in phases_spec:
            result.phases.append(run_phase(handle, target.path, cfg, label, direction, random, pattern=pattern,
                                           progress=cfg.progress))
            if after_phase is not None:
                after_phase(label, target.path)
        if cfg.verify:
            if direction == "write":
                if layout is None:
                    layout = _layout_handle(cfg, handle.engine, direct)
                _sequential_pass(layout, "read", target.path, cfg.size, pattern, cfg.progress, "verify")
            result.verify = f"passed ({report.fmt_bytes(cfg.size)} checked)"
        if fio is not None and not cfg.fio_first:
            _compare_fio(fio, result, cfg, log)
        failed = False
        return result
    finally:
        with _no_interrupts():
            for h in (handle, layout):
                if h is not None:
                    h.close()  # waits for every queued request before the buffers go
            target.finish(failed)


def _compare_fio(fio, result, cfg, log):
    """fio on the same file with the same settings, one run per phase, into result.fio."""
    out = result.fio
    for label, direction, _ in RW_PHASES[cfg.rw]:
        cmd = fiocompare.fio_command(fio, path=result.path, rw=label, bs=cfg.bs, iodepth=cfg.iodepth,
                                     threads=cfg.threads, size=cfg.size, engine=result.engine,
                                     direct=result.direct, runtime=cfg.runtime, warmup=cfg.warmup,
                                     loops=cfg.loops)
        if log:
            log(f"running {fiocompare.format_command(cmd)}")
        _drop_cache(result.path)
        limit = (cfg.runtime + cfg.warmup + 120) if cfg.runtime else 120 + cfg.size * cfg.loops / 50e6
        job = fiocompare.run_fio(cmd, timeout=limit)
        keep = ("io_bytes", "bw_bytes", "bw", "iops", "runtime", "total_ios", "clat_ns", "lat_ns")
        out["phases"][f"{label}:{direction}"] = {
            "job": {direction: {k: job[direction][k] for k in keep},
                    "usr_cpu": job["usr_cpu"], "sys_cpu": job["sys_cpu"], "job options": job["job options"]}}
        out["commands"].append(fiocompare.format_command(cmd))
