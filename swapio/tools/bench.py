"""`swapio bench`: fio-style bandwidth, IOPS, latency and CPU use of swapio's native I/O path on one file.

The phases run on the load generator (swapio.tools.loadgen). `run_bench(BenchConfig(...))` is the entry point
for scripts; the command line is in swapio.tools.cli.
"""
import contextlib
import dataclasses
import os
import time
from typing import Optional

import numpy as np

from .. import _C
from .._version import __version__
from ..core.handle import AioHandle
from . import fiocompare, hostmem, loadgen, report
from .errors import ToolError, UsageError, VerifyError  # noqa: F401  (VerifyError: what --verify raises)
from .pattern import Pattern
from .testfile import TestFile, no_interrupts

RW_PHASES = {  # --rw -> phases in order: (label, direction, random)
    "read": [("read", "read", False)],
    "write": [("write", "write", False)],
    "randread": [("randread", "read", True)],
    "randwrite": [("randwrite", "write", True)],
    "rw": [("write", "write", False), ("read", "read", False)],
}
DESCRIPTIONS = {"read": "sequential read", "write": "sequential write", "randread": "random read",
                "randwrite": "random write", "rw": "sequential write then read"}
ENGINES = ("auto", *_C.ENGINES)

_RAND_REQUEST = 16 << 20  # bytes per random request (count = this / bs, clamped)
_LAYOUT_BLOCK = 1 << 20


class BenchError(ToolError):
    """A problem with the user's input or environment: printed as one line by the CLI."""


class BenchUsageError(BenchError, UsageError):
    """Settings that cannot run as given (out of range, not mixing, not fitting the file or its file system):
    the CLI exits 2 for it."""


@dataclasses.dataclass
class BenchConfig:
    rw: str = "rw"
    bs: int = 1 << 20
    iodepth: int = 32
    threads: int = 1
    size: int = 1 << 30
    engine: str = "auto"
    direct: Optional[bool] = None  # None: O_DIRECT where the file system takes it; True: required; False: buffered
    file: Optional[str] = None  # a named file (kept afterwards, like fio), or
    directory: Optional[str] = None  # a temporary file in this directory (default: the working directory),
                                     # removed afterwards
    runtime: Optional[float] = None  # seconds, time-based; else `loops` passes over the file
    loops: int = 1
    warmup: float = 0.0        # seconds of I/O before measuring (fio's ramp_time)
    verify: bool = False
    compare_fio: bool = False
    fio_first: bool = False    # with compare_fio: fio's phases before swapio's (alternate to cancel drift)
    progress: Optional[bool] = None  # True: show a bar, False: none, None: on a terminal (swapio._progress)

    def validate(self):
        if self.rw not in RW_PHASES:
            raise BenchUsageError(f"--rw must be one of {', '.join(RW_PHASES)}, got {self.rw!r}")
        if self.engine not in ENGINES:
            raise BenchUsageError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for name, value, lo, hi in (("--bs", self.bs, 1, _C.MAX_BLOCK_SIZE),
                                    ("--iodepth", self.iodepth, 1, _C.MAX_QUEUE_DEPTH),
                                    ("--threads", self.threads, 1, _C.MAX_THREADS), ("--loops", self.loops, 1, None)):
            if value < lo or (hi is not None and value > hi):
                raise BenchUsageError(f"{name} must be between {lo} and {hi}, got {value}" if hi else
                                 f"{name} must be at least {lo}, got {value}")
        if self.size < self.bs:
            raise BenchUsageError(f"--size ({self.size}) must be at least --bs ({self.bs})")
        if self.size % self.bs:
            raise BenchUsageError(f"--size ({report.fmt_size(self.size)}) must be a multiple of --bs "
                             f"({report.fmt_size(self.bs)})")
        if self.size // self.bs < self.threads:
            raise BenchUsageError(f"--size holds {self.size // self.bs} blocks, fewer than --threads ({self.threads})")
        if self.runtime is not None and not self.runtime > 0:
            raise BenchUsageError(f"--runtime must be > 0, got {self.runtime}")
        if not self.warmup >= 0:
            raise BenchUsageError(f"--warmup must be >= 0, got {self.warmup}")
        if self.verify and self.bs % 8:
            raise BenchUsageError(f"--verify needs --bs a multiple of 8, got {self.bs}")
        if self.file is not None and self.directory is not None:
            raise BenchUsageError("give --file or --dir, not both")
        if self.fio_first and not self.compare_fio:
            raise BenchUsageError("--fio-first needs --compare-fio")
        if self.fio_first and self.verify:
            raise BenchUsageError("--fio-first and --verify don't mix (fio's writes would replace the pattern)")
        moves_data = self.engine == "auto" or self.engine in _C.DATA_ENGINES
        if self.verify and not moves_data:
            raise BenchUsageError("--verify needs a real engine (null moves no data)")
        if self.compare_fio and not moves_data:
            raise BenchUsageError("--compare-fio needs a real engine (not null)")


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
    verify: Optional[str] = None
    fio: Optional[dict] = None
    shown: Optional[str] = None  # the file's name in reports (path: /proc/<pid>/fd/<n> for a temporary one)
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
                   "filename": self.shown or self.path}
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
            "swapio": {"engine": self.engine, "direct": self.direct, "filename": self.shown or self.path,
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


def _seq_chunk(cfg, size):
    chunk = max(loadgen.SEQ_REQUEST, cfg.bs * cfg.iodepth * cfg.threads)
    chunk = chunk // cfg.bs * cfg.bs
    return min(chunk, size)


def _per_request(cfg):
    """(pieces per random request, pieces in all or None when time-based)."""
    # enough pieces per request to fill every queue, ~16 MiB when pieces are small
    per_request = max(cfg.iodepth * cfg.threads, min(1 << 16, _RAND_REQUEST // cfg.bs))
    total = None if cfg.runtime else cfg.loops * (cfg.size // cfg.bs)
    return (per_request if total is None else min(per_request, total)), total


def _buffer_sizes(cfg, random, with_pattern):
    """The pinned buffers of a phase: with a pattern each outstanding request has its own, so its bytes can be
    checked; else the requests share one (fio's memory use, not its contents, matters here)."""
    if random:
        per_request, _ = _per_request(cfg)
        if with_pattern:
            return [per_request * cfg.bs] * loadgen.OUTSTANDING
        return [max(1, min(per_request, cfg.iodepth * cfg.threads)) * cfg.bs]
    return [_seq_chunk(cfg, cfg.size)] * (loadgen.OUTSTANDING if with_pattern else 1)


def _require_memory(cfg):
    """Refuses up front (before any file is laid out) settings whose buffers this machine cannot hold."""
    need = max(sum(_buffer_sizes(cfg, random, cfg.verify)) for _, _, random in RW_PHASES[cfg.rw])
    hostmem.require(need, f"--bs {report.fmt_size(cfg.bs)} x --iodepth {cfg.iodepth} x --threads {cfg.threads}"
                    + (" with --verify" if cfg.verify else ""), "use a smaller --bs, --iodepth or --threads")


def run_phase(handle, path, cfg, label, direction, random, *, pattern=None, progress=False):
    """One measured phase on `path` with `handle`; returns a Phase."""
    size = cfg.size
    loadgen.drop_cache(path)
    buffers = [loadgen.pinned_buffer(n, direction == "write" and pattern is None)
               for n in _buffer_sizes(cfg, random, pattern is not None)]
    per_request, total = _per_request(cfg)
    chunk = _seq_chunk(cfg, size)
    if random:
        submit = loadgen.random_submitter(handle, direction, path, size, per_request, buffers, pattern, total)
        count = None if total is None else -(-total // per_request)
    else:
        submit = loadgen.sequential_submitter(handle, direction, path, size, chunk, buffers, pattern)
        count = None if cfg.runtime else cfg.loops * (-(-size // chunk))
    bar = loadgen.Progress(progress, label, total_bytes=None if cfg.runtime else cfg.loops * size,
                    seconds=(cfg.runtime + cfg.warmup) if cfg.runtime else None)
    try:
        nbytes, nios, seconds, lat, usr, sys_ = loadgen.pump(submit, count=count, runtime=cfg.runtime,
                                                             warmup=cfg.warmup, progress=bar)
    finally:
        bar.close()
    return Phase(label, direction, nbytes, nios, seconds, lat, usr, sys_)


def _layout_handle(cfg, engine, direct):
    return AioHandle(block_size=max(_LAYOUT_BLOCK, cfg.bs), queue_depth=32, threads=1, engine=engine, direct=direct)


def verify_file(path, size, *, engine="auto", direct=None, progress=False):
    """Reads [0, size) of `path` and checks it holds the --verify pattern; raises VerifyError at the first
    wrong byte. (The read-verify pass of `swapio bench --verify`, exposed for tests and scripts.)"""
    if size % 8:
        raise BenchError(f"verify size must be a multiple of 8, got {size}")
    with AioHandle(block_size=_LAYOUT_BLOCK, queue_depth=32, threads=1, engine=engine, direct=direct) as h:
        pattern = Pattern(min(loadgen.SEQ_REQUEST, size))
        loadgen.sequential_pass(h, "read", path, size, pattern, progress, "verify")


def _resolve_direct(target, cfg):
    probe = _C.probe_file(target.path)
    if cfg.direct is False:
        return False, probe
    if not probe["direct"]:
        if cfg.direct:
            raise BenchUsageError(f"the file system of {target.directory} refuses O_DIRECT; use --buffered")
        return False, probe
    align = probe["offset_align"]
    if cfg.bs % align:
        raise BenchUsageError(f"--bs {cfg.bs} is not a multiple of the direct-I/O alignment ({align} bytes) of "
                         f"{target.directory}; use a multiple of {align} or --buffered")
    return True, probe


def run_bench(cfg, *, after_phase=None, log=None):
    """Runs a benchmark; returns a BenchResult. Raises BenchError (bad input, VerifyError), OSError (I/O) or
    fiocompare.FioError; the temporary file is removed whatever happens, Ctrl-C included.

    after_phase(label, path) runs after each measured phase (tests corrupt the file there).
    log(message) receives notes (e.g. the buffered fallback)."""
    cfg.validate()
    _require_memory(cfg)
    phases_spec = RW_PHASES[cfg.rw]
    writes = any(d == "write" for _, d, _ in phases_spec)
    fio = fiocompare.find_fio() if cfg.compare_fio else None
    target = TestFile(cfg.file, cfg.directory)
    handle = layout = None
    failed = True
    try:
        direct, _ = _resolve_direct(target, cfg)
        if cfg.direct is None and not direct and log:
            log(f"the file system of {target.directory} refuses O_DIRECT: running buffered")
        reads_first = phases_spec[0][1] == "read"
        have = target.current_size()
        if not target.created and reads_first and have < cfg.size:
            raise BenchUsageError(f"--file {cfg.file} holds {have} bytes, fewer than --size {cfg.size}; use a "
                             "smaller --size, or a write run first")
        # A new file is written out before the measured phases when they read it and for --compare-fio (fio then
        # runs on the same, written file); any file, with the pattern, when --verify checks every piece after
        # writes that may leave some unwritten: random ones, or a time-based run that ends before a whole pass.
        partial_writes = writes and (cfg.rw == "randwrite" or cfg.runtime is not None)
        needs_layout = (target.created and (reads_first or cfg.compare_fio)) or (cfg.verify and partial_writes)
        if writes or needs_layout:
            target.check_free_space(cfg.size)
        try:
            handle = AioHandle(cfg.bs, cfg.iodepth, cfg.threads, cfg.engine, direct)
        except OSError as e:
            raise BenchUsageError(f"engine {cfg.engine}: {e.strerror or e}") from None
        pattern = Pattern(max(_seq_chunk(cfg, cfg.size), min(loadgen.SEQ_REQUEST, cfg.size))) if cfg.verify else None
        if target.created and writes and not needs_layout:
            with contextlib.suppress(OSError):  # like fio's fallocate=native: the writes then overwrite
                fd = os.open(target.path, os.O_WRONLY)
                try:
                    os.posix_fallocate(fd, 0, cfg.size)
                finally:
                    os.close(fd)
        if needs_layout:
            layout = _layout_handle(cfg, handle.engine, direct)
            loadgen.sequential_pass(layout, "write", target.path, cfg.size, pattern, cfg.progress, "laying out")
        result = BenchResult(cfg, target.path, target.temporary, handle.engine, direct, [], shown=target.shown)
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
                loadgen.sequential_pass(layout, "read", target.path, cfg.size, pattern, cfg.progress, "verify")
            result.verify = f"passed ({report.fmt_bytes(cfg.size)} checked)"
        if fio is not None and not cfg.fio_first:
            _compare_fio(fio, result, cfg, log)
        failed = False
        return result
    finally:
        with no_interrupts():
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
        loadgen.drop_cache(result.path)
        limit = (cfg.runtime + cfg.warmup + 120) if cfg.runtime else 120 + cfg.size * cfg.loops / 50e6
        job = fiocompare.run_fio(cmd, timeout=limit)
        keep = ("io_bytes", "bw_bytes", "bw", "iops", "runtime", "total_ios", "clat_ns", "lat_ns")
        out["phases"][f"{label}:{direction}"] = {
            "job": {direction: {k: job[direction][k] for k in keep},
                    "usr_cpu": job["usr_cpu"], "sys_cpu": job["sys_cpu"], "job options": job["job options"]}}
        out["commands"].append(fiocompare.format_command(cmd))
