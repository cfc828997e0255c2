"""`swapio tune`: find the fastest AioHandle settings for a disk, and write them as a config.

The sweep is smart rather than exhaustive (block size x queue depth x threads x engine, read and write, would be
over a thousand points):
  1. coarse: a spread 3 x 3 grid of block size x queue depth (psync: x threads, its only parallelism) per
     engine and direction;
  2. engines whose best coarse figure is under 85 % of the leader's are dropped;
  3. refine: hill-climb from the best point to neighbouring block sizes and depths while a step gains > 3 %;
  4. threads: more workers at the best point while each doubling gains > 5 %;
  5. final round: the top settings of each direction are measured again for both directions, interleaved,
     and judged on medians (single figures swing by tens of % on shared machines).
Each point is a short time-based run (swapio.tools.loadgen's pump: a few large requests outstanding, latency per piece).
What is shown of the result (the summary table, the --plot heat maps) is tune_report.py's.
"""
import dataclasses
import datetime
import json
import math
import statistics
import time
from typing import Optional

import numpy as np


from .. import _C, _progress
from .._version import __version__
from ..core.handle import AioHandle
from . import loadgen, report
from .errors import ToolError, UsageError
from .testfile import TestFile, no_interrupts

CONFIG_NAME = "swapio-io.json"  # written into the tuned directory unless -o says otherwise
DEFAULT_SIZE = 512 << 20
DEFAULT_POINT_TIME = 0.4
DEFAULT_WARMUP = 0.1
DEFAULT_BUDGET = 100.0
BLOCK_SIZES = tuple(k << 10 for k in (64, 128, 256, 512, 1024, 2048, 4096, 8192))
DEPTHS = (1, 2, 4, 8, 16, 32, 64, 128)
THREADS = (1, 2, 4)
MAX_INFLIGHT = 128 << 20   # skip points with more than this many bytes in flight (bs * iodepth * threads)
_TUNE_REQUEST = 16 << 20
REFINE_GAIN = 1.03
THREAD_GAIN = 1.05
ENGINE_CUTOFF = 0.85
FINAL_TOP = 3
FINAL_ROUNDS = 2


class TuneError(ToolError):
    """Bad tune input or environment: printed as one line by the CLI."""


class TuneUsageError(TuneError, UsageError):
    """Settings that cannot run as given: the CLI exits 2 for it."""


@dataclasses.dataclass
class TuneConfig:
    directory: Optional[str] = None
    size: int = DEFAULT_SIZE
    ops: tuple = ("read", "write")
    engines: Optional[tuple] = None  # None: every usable engine
    block_sizes: tuple = BLOCK_SIZES
    depths: tuple = DEPTHS
    threads: tuple = THREADS
    point_time: float = DEFAULT_POINT_TIME
    warmup: float = DEFAULT_WARMUP
    budget: float = DEFAULT_BUDGET
    direct: Optional[bool] = None
    progress: Optional[bool] = None  # True: show a bar, False: none, None: on a terminal (swapio._progress)

    def validate(self):
        # a direction or engine named twice is swept once (twice would pool two sweeps' runs into each point)
        self.ops = tuple(dict.fromkeys(self.ops))
        if self.engines is not None:
            self.engines = tuple(dict.fromkeys(self.engines))
        for op in self.ops:
            if op not in ("read", "write"):
                raise TuneUsageError(f"--rw takes read and/or write, got {op!r}")
        if not self.ops:
            raise TuneUsageError("--rw is empty")
        status = _C.engine_status()
        if self.engines is None:
            self.engines = tuple(e for e in _C.AUTO_ENGINE_ORDER if status.get(e) == "ok")
            if not self.engines:
                raise TuneError("no usable I/O engine here (see swapio info)")
        for e in self.engines:
            if e not in status:
                raise TuneUsageError(f"unknown engine {e!r} (choose from {', '.join(status)})")
            if status[e] != "ok":
                raise TuneUsageError(f"engine {e} is unavailable here: {status[e]}")
            if e not in _C.DATA_ENGINES:  # its figures would become the disk's config: writes that go nowhere
                raise TuneUsageError(f"engine {e} moves no data, so there is no disk to tune with it (swapio bench "
                                     f"--engine {e} measures swapio's own overhead)")
        for name, values, lo in (("--bs", self.block_sizes, 1), ("--iodepth", self.depths, 1),
                                 ("--threads", self.threads, 1)):
            if not values or min(values) < lo:
                raise TuneUsageError(f"{name} values must be >= {lo}, got {list(values)}")
        self.block_sizes = tuple(sorted(set(self.block_sizes)))
        self.depths = tuple(sorted(set(self.depths)))
        self.threads = tuple(sorted(set(self.threads)))
        if max(self.depths) > _C.MAX_QUEUE_DEPTH or max(self.threads) > _C.MAX_THREADS:
            raise TuneUsageError(f"--iodepth must be <= {_C.MAX_QUEUE_DEPTH} and --threads <= {_C.MAX_THREADS}")
        if self.size < min(self.block_sizes) * min(self.threads):
            raise TuneUsageError(f"--size {self.size} is smaller than the smallest block size x threads")
        if not self.point_time > 0 or not self.budget >= 0:
            raise TuneUsageError("--point-time must be > 0 and --budget >= 0")


@dataclasses.dataclass
class Point:
    engine: str
    op: str
    bs: int
    iodepth: int
    threads: int
    gbps: list = dataclasses.field(default_factory=list)
    p99_ns: list = dataclasses.field(default_factory=list)

    @property
    def setting(self):
        return (self.engine, self.bs, self.iodepth, self.threads)

    @property
    def median(self):
        return statistics.median(self.gbps) if self.gbps else float("nan")


@dataclasses.dataclass
class TuneResult:
    config: TuneConfig
    directory: str
    direct: bool
    points: dict            # (engine, op, bs, qd, threads) -> Point
    best: dict              # op -> setting (engine, bs, qd, threads)
    both: tuple             # setting
    seconds: float
    stages: dict

    def figure(self, setting, op):
        p = self.points.get((setting[0], op, *setting[1:]))
        return p.median if p else float("nan")

    def handle_config(self, setting):
        engine, bs, qd, th = setting
        return {"block_size": bs, "queue_depth": qd, "threads": th, "engine": engine, "direct": self.direct}

    def json(self):
        best = {op: {"handle": self.handle_config(s), "gb_s": self.figure(s, op)} for op, s in self.best.items()}
        both = {"handle": self.handle_config(self.both),
                **{f"{op}_gb_s": self.figure(self.both, op) for op in self.config.ops}}
        return {
            "swapio_version": __version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "directory": self.directory, "file_size": self.config.size, "direct": self.direct,
            "seconds": round(self.seconds, 1), "point_time": self.config.point_time,
            "points_per_stage": self.stages,
            "best": best, "both": both,
            "sweep": [{"engine": p.engine, "op": p.op, "bs": p.bs, "iodepth": p.iodepth, "threads": p.threads,
                       "gb_s": [round(g, 4) for g in p.gbps], "median_gb_s": round(p.median, 4),
                       "p99_ns": p.p99_ns} for p in self.points.values()],
        }


def write_config(result, path):
    """{"handle": best for read+write, "read": ..., "write": ..., "measured": {...}}: AioHandle.from_config
    reads "handle" (and from_config(cfg["read"]) the read-tuned one); everything else is information."""
    doc = {"handle": result.handle_config(result.both)}
    for op, setting in result.best.items():
        doc[op] = result.handle_config(setting)
    doc["measured"] = result.json()
    report.write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def _spread(values, n):
    """n values spread over a sorted list, avoiding its extremes when it is long enough."""
    if len(values) <= n:
        return list(values)
    picks = sorted({min(len(values) - 1, int((i + 0.5) * len(values) / n)) for i in range(n)})
    return [values[i] for i in picks]


class _Sweeper:
    def __init__(self, cfg, path, direct, log, bar):
        self.cfg, self.path, self.direct, self.log, self.bar = cfg, path, direct, log, bar
        self.points = {}
        self.failed = set()
        self.stage_counts = {}
        self.stage = "coarse"
        self.deadline = time.perf_counter() + cfg.budget
        chunk = min(max(_TUNE_REQUEST, MAX_INFLIGHT), cfg.size)
        self.buffer = loadgen.pinned_buffer(chunk, True)

    def valid(self, engine, bs, qd, th):
        inflight = bs * (1 if engine in _C.SYNC_ENGINES else qd) * th
        return inflight <= MAX_INFLIGHT and bs * th <= self.cfg.size

    def out_of_time(self):
        return time.perf_counter() > self.deadline

    def measure(self, engine, op, bs, qd, th):
        key = (engine, op, bs, qd, th)
        if key in self.failed:
            return None
        size = self.cfg.size // bs * bs
        # requests just big enough to fill the queues: the run ends soon after point_time
        chunk = min(max(_TUNE_REQUEST, bs * qd * th) // bs * bs, size)
        try:
            h = AioHandle(bs, qd, th, engine, self.direct)
        except OSError as e:  # e.g. aio-max-nr reached at a large depth x threads: skip the point
            self.failed.add(key)
            if self.log:
                self.log(f"skipping {engine} bs {report.fmt_size(bs)} iodepth {qd} threads {th}: {e.strerror or e}")
            return None
        point = self.points.setdefault(key, Point(engine, op, bs, qd, th))
        with h:
            loadgen.drop_cache(self.path)
            submit = loadgen.sequential_submitter(h, op, self.path, size, chunk, [self.buffer], None)
            nbytes, _, secs, lat, _, _ = loadgen.pump(submit, runtime=self.cfg.point_time, warmup=self.cfg.warmup)
        point.gbps.append(nbytes / secs / 1e9)
        point.p99_ns.append(int(np.percentile(lat, 99)) if lat.size else 0)
        self.stage_counts[self.stage] = self.stage_counts.get(self.stage, 0) + 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.stage}: {op} {engine} bs {report.fmt_size(bs)} qd {qd} "
                                     f"x{th} {point.gbps[-1]:.2f} GB/s", refresh=False)
            self.bar.update(1)
        return point

    def best_of(self, op, engine=None):
        pts = [p for p in self.points.values() if p.op == op and (engine is None or p.engine == engine)]
        return max(pts, key=lambda p: p.median) if pts else None

    # a sync engine (psync) runs its pieces one at a time per worker: threads are its parallelism, depth stays 1
    def axes(self, engine):
        c = self.cfg
        if engine in _C.SYNC_ENGINES:
            return "threads", c.threads
        return "iodepth", c.depths

    def key_of(self, engine, bs, x, th=1):
        return (bs, 1, x) if engine in _C.SYNC_ENGINES else (bs, x, th)

    def coarse(self, op, engine):
        _, xs = self.axes(engine)
        for bs in _spread(self.cfg.block_sizes, 3):
            for x in _spread(xs, 3):
                b, qd, th = self.key_of(engine, bs, x)
                if self.valid(engine, b, qd, th):
                    self.measure(engine, op, b, qd, th)

    def refine(self, op, engine):
        axis, xs = self.axes(engine)
        bss = self.cfg.block_sizes
        for _ in range(8):
            if self.out_of_time():
                return
            cur = self.best_of(op, engine)
            x = cur.threads if axis == "threads" else cur.iodepth
            i, j = bss.index(cur.bs), xs.index(x)
            tried = False
            for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
                if 0 <= i + di < len(bss) and 0 <= j + dj < len(xs):
                    b, qd, th = self.key_of(engine, bss[i + di], xs[j + dj], cur.threads)
                    if (engine, op, b, qd, th) not in self.points and self.valid(engine, b, qd, th):
                        self.measure(engine, op, b, qd, th)
                        tried = True
            new = self.best_of(op, engine)
            if not tried or new.median < cur.median * REFINE_GAIN:
                return

    def more_threads(self, op, engine):
        if engine in _C.SYNC_ENGINES:
            return
        cur = self.best_of(op, engine)
        for th in self.cfg.threads:
            if th <= cur.threads or self.out_of_time():
                continue
            if not self.valid(engine, cur.bs, cur.iodepth, th):
                break
            p = self.measure(engine, op, cur.bs, cur.iodepth, th)
            if p is None or p.median < cur.median * THREAD_GAIN:
                break
            cur = p

    def final(self):
        """Top settings of each direction, measured again for every direction, interleaved."""
        self.stage = "final"
        settings = []
        for op in self.cfg.ops:
            ranked = sorted((p for p in self.points.values() if p.op == op), key=lambda p: -p.median)
            for p in ranked[:FINAL_TOP]:
                if p.setting not in settings:
                    settings.append(p.setting)
        for _ in range(FINAL_ROUNDS):
            for engine, bs, qd, th in settings:
                for op in self.cfg.ops:
                    self.measure(engine, op, bs, qd, th)
        # a setting is judged only on directions it was measured in
        return [s for s in settings if all((s[0], op, *s[1:]) in self.points for op in self.cfg.ops)]


def run_tune(cfg, log=None):
    cfg.validate()
    start = time.perf_counter()
    target = TestFile(directory=cfg.directory)
    bar = None
    try:
        probe = _C.probe_file(target.path)
        direct = bool(probe["direct"]) and cfg.direct is not False
        if cfg.direct and not probe["direct"]:
            raise TuneUsageError(f"the file system of {target.directory} refuses O_DIRECT; use --buffered")
        if direct:
            align = probe["offset_align"]
            cfg.block_sizes = tuple(b for b in cfg.block_sizes if b % align == 0)
            if not cfg.block_sizes:
                raise TuneUsageError(f"no block size is a multiple of the direct-I/O alignment ({align} bytes)")
        elif cfg.direct is None and log:
            log(f"the file system of {target.directory} refuses O_DIRECT: tuning buffered I/O")
        target.check_free_space(cfg.size)
        with AioHandle(1 << 20, 32, 1, "auto", direct) as h:
            loadgen.sequential_pass(h, "write", target.path, cfg.size, None, False, "laying out")
        bar = _progress.bar(cfg.progress, desc="tune", unit=" points", leave=False, dynamic_ncols=True)
        sw = _Sweeper(cfg, target.path, direct, log, bar)
        for op in cfg.ops:
            sw.stage = "coarse"
            for engine in cfg.engines:
                sw.coarse(op, engine)
            if sw.best_of(op) is None:
                raise TuneError(f"no {op} point could be measured (see the messages above)")
            leader = sw.best_of(op).median
            kept = [e for e in cfg.engines if sw.best_of(op, e) and sw.best_of(op, e).median >= ENGINE_CUTOFF * leader]
            sw.stage = "refine"
            for engine in kept:
                sw.refine(op, engine)
            sw.stage = "threads"
            for engine in kept:
                sw.more_threads(op, engine)
        settings = sw.final()
        if not settings:
            raise TuneError("no setting could be measured in every direction")
        best = {}
        for op in cfg.ops:
            cands = [sw.points[(s[0], op, *s[1:])] for s in settings]
            best[op] = max(cands, key=lambda p: p.median).setting
        tops = {op: max(sw.points[(best[op][0], op, *best[op][1:])].median, 1e-12) for op in cfg.ops}

        def score(s):
            return math.exp(sum(math.log(max(sw.points[(s[0], op, *s[1:])].median, 1e-12) / tops[op])
                                for op in cfg.ops) / len(cfg.ops))

        both = max(settings, key=score)
        return TuneResult(cfg, target.directory, direct, sw.points, best, both, time.perf_counter() - start,
                          dict(sw.stage_counts))
    finally:
        if bar is not None:
            bar.close()
        with no_interrupts():
            target.finish(True)  # the sweep's file always goes
