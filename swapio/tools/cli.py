"""The `swapio` command (also `python -m swapio`): demo, plan, bench, tune, info.

Errors are one line on stderr and a non-zero exit status (2: bad usage, a missing or unusable path included;
1: failure; 130: interrupted); set SWAPIO_DEBUG=1 to get Python tracebacks instead.
"""
import argparse
import json
import os
import re
import signal
import sys
import threading
import warnings

from .. import _C, _env
from .._interrupt import interrupted
from . import memplan, report
from .errors import PathError, UsageError

EXIT_FAILURE, EXIT_USAGE, EXIT_TERMINATED = 1, 2, 143  # EXIT_INTERRUPTED: 130 (swapio._interrupt)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # "-1M", "-2s" are values (refused for their sign), not unknown options: argparse took only "-1" and "-.5"
        # as numbers, so `--size -1M` failed with "expected one argument"
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):  # one line, no usage dump
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def _arg_type(parse):
    """An argparse type from a parser that raises ValueError: its message becomes argparse's usage error."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__  # argparse names the type in some messages
    return convert


_size = _arg_type(report.parse_size)


def _memory_size(text):
    """A memory capacity: positive, with a unit (a bare `--ram 64` would be 64 bytes, never what was meant)."""
    n = _positive_size(text)
    if text.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"{text!r} has no unit: sizes are binary, with K, M, G or T (did you mean {text.strip()}G, "
                         f"{text.strip()} GiB?)")
    return n


def _positive_size(text):
    n = report.parse_size(text)
    if n <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return n
_duration = _arg_type(report.parse_duration)
_count = _arg_type(memplan.parse_count)


def _int(text):
    try:
        return int(text, 10)  # decimal, as sizes are: "010" is ten, "0x10" refused
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _list(convert):
    def parse(text):
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} is an empty list")
        return [convert(t.strip()) for t in items]
    return parse


def _add_progress(p, quiet_help):
    """-q and --progress: the one progress rule of every command (swapio._progress): a bar on stderr only when
    it is a terminal, unless --progress (always) or -q (never); SWAPIO_PROGRESS=1/0 sets the default."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help=quiet_help)
    g.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a "
                   "terminal (default: only on a terminal; SWAPIO_PROGRESS=1 or 0 changes that default)")


def _add_direct(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--direct", dest="direct", action="store_const", const=True, default=None,
                   help="O_DIRECT, an error where the file system refuses it")
    g.add_argument("--buffered", dest="direct", action="store_const", const=False,
                   help="buffered I/O (through the page cache)")


BENCH_EXAMPLES = """
examples:
  swapio bench                                  write then read a 1 GiB temporary file here, 1M blocks, QD 32
  swapio bench --rw read --bs 128K --dir /nvme --runtime 10 --warmup 1 --compare-fio
  swapio bench --rw randread --bs 4K --iodepth 64 --size 2G --runtime 10 --json --output rr.json
  swapio bench --rw write --verify --file /nvme/f --size 256M   then --rw read --verify on the same file

JSON (--json) is shaped like fio's: jobs[0].read / jobs[0].write with bw_bytes, bw (KiB/s), iops, runtime (ms),
clat_ns / lat_ns {min, max, mean, stddev, N, percentile{"99.000000": ns}}, plus bw_mib_s, bw_gb_s, usr_cpu,
sys_cpu per direction and jobs[0].swapio (the settings as run); with --compare-fio a top-level "fio" block.
"""


def _bench_parser(sub):
    p = sub.add_parser("bench", help="fio-style throughput and latency of a disk through swapio",
                       description="fio-style benchmark of swapio's async I/O on one file. Sizes take K, M, G, "
                                   "T suffixes (binary, like fio).",
                       epilog=BENCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    p.add_argument("--rw", default="rw", choices=["read", "write", "randread", "randwrite", "rw"],
                   help="workload (default rw: a sequential write pass, then a read pass)")
    p.add_argument("--bs", type=_size, default="1M", help="block size: bytes per I/O (default 1M)")
    p.add_argument("--iodepth", type=_int, default=32, help="I/Os in flight per thread (default 32)")
    p.add_argument("--threads", "--numjobs", dest="threads", type=_int, default=1,
                   help="worker threads, each with its own queue and a stripe of the file (default 1)")
    p.add_argument("--size", type=_size, default="1G", help="file size (default 1G)")
    p.add_argument("--engine", default="auto", choices=["auto", *_C.ENGINES],
                   help=f"I/O engine (default auto: the first usable of {', '.join(_C.AUTO_ENGINE_ORDER)})")
    _add_direct(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--file", help="run on this file (created if missing; kept afterwards)")
    where.add_argument("--dir", dest="directory",
                       help="run on a temporary file in this directory, removed afterwards (default: .)")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--runtime", type=_duration, help="time-based: run this long (seconds, or 500ms, 2m)")
    limit.add_argument("--loops", type=_int, default=1, help="passes over the file (default 1)")
    p.add_argument("--warmup", type=_duration, default=0.0, help="I/O before measuring, like fio's ramp_time")
    p.add_argument("--verify", action="store_true",
                   help="write a known pattern and check every byte read back")
    p.add_argument("--compare-fio", action="store_true",
                   help="also run fio on the same file with the same settings; print both and the ratio")
    p.add_argument("--fio-first", action="store_true",
                   help="with --compare-fio: run fio's phases before swapio's (alternate runs to cancel drift)")
    p.add_argument("--json", action="store_true", help="fio-shaped JSON instead of the table")
    p.add_argument("--output", metavar="FILE", help="write the output to FILE instead of stdout")
    _add_progress(p, "no progress bar, no notes")
    p.set_defaults(run=_run_bench)
    return p


def _demo_parser(sub):
    from .demo import OPTIMIZERS, DemoConfig
    d = DemoConfig()
    p = sub.add_parser("demo", help="train a small GPT with torch AdamW and OffloadAdamW (cpu, nvme) side by side",
                       description="Trains three copies of a small byte-level GPT on text from Python's standard "
                                   "library, on the same batches: torch.optim.AdamW, OffloadAdamW(offload=\"cpu\") "
                                   "and OffloadAdamW(offload=\"nvme\") (swap file in a temporary directory under "
                                   "--dir, removed afterwards). Prints the losses, the optimizer step times and the "
                                   "host memory each optimizer holds for its state (measured).",
                       allow_abbrev=False)
    p.add_argument("--steps", type=_int, default=d.steps, help=f"training steps (default {d.steps})")
    p.add_argument("--layers", type=_int, default=d.layers, help=f"transformer blocks (default {d.layers})")
    p.add_argument("--width", type=_int, default=d.width, help=f"embedding width (default {d.width})")
    p.add_argument("--heads", type=_int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--context", type=_int, default=d.context, help=f"bytes per sequence (default {d.context})")
    p.add_argument("--batch", type=_int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr:g})")
    p.add_argument("--log-every", type=_int, default=d.log_every, help="steps between table rows (default 10)")
    p.add_argument("--buffer", dest="buffer_bytes", type=_size, default=fmt(d.buffer_bytes),
                   help="pinned RAM of the nvme pipeline, OffloadAdamW's buffer_bytes (default 1M)")
    p.add_argument("--dir", dest="directory", default=".", help="where the temporary swap directory goes "
                   "(default: .)")
    p.add_argument("--seed", type=_int, default=d.seed, help="model and data seed (default 0)")
    p.add_argument("--optimizer", default=d.optimizer, choices=list(OPTIMIZERS),
                   help="adamw: torch.optim.AdamW vs OffloadAdamW; adafactor: torch.optim.Adafactor vs "
                        "OffloadAdafactor (default adamw)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the three loss curves (needs matplotlib)")
    _add_progress(p, "no progress bar")
    p.set_defaults(run=_run_demo)
    return p


def _plan_parser(sub):
    p = sub.add_parser("plan", help="memory arithmetic: where weights, gradients and optimizer state fit",
                       description="Bytes per parameter for weights, gradients and optimizer state; where they "
                                   "sit with and without swapio's optimizer offload (GPU, RAM, disk), with a GPU "
                                   "and without one (training on the CPU), whether that fits, and the expected "
                                   "nvme-mode step time on --disk. Memory sizes are binary, given and printed: "
                                   "--ram 64G is 64 GiB (2^30 bytes) and prints as 64.0 GiB; --gpu-mem and --ram "
                                   "need a unit (K, M, G, T). Parameter counts are decimal (7B = 7e9).",
                       allow_abbrev=False)
    p.add_argument("--params", type=_count, help="parameter count, e.g. 7B, 125M, 7e9 (or --shapes)")
    p.add_argument("--shapes", metavar="FILE", help="a JSON list of the parameters' shapes, or a dict of name: "
                   "shape (json.dump([list(p.shape) for p in model.parameters()], f)), instead of --params: the "
                   "moments are counted tensor by tensor, as the optimizer allocates them (adafactor's factors "
                   "of convolutions, int8's scales of small tensors)")
    p.add_argument("--dtype", default="bf16", choices=list(memplan.WEIGHT_BYTES),
                   help="weights and gradients (default bf16)")
    p.add_argument("--optimizer", default="adamw", choices=list(memplan.MOMENT_COUNT), help="(default adamw)")
    p.add_argument("--state-dtype", default="fp32", choices=list(memplan.STATE_BYTES),
                   help="storage of the moments (default fp32); the master weights stay fp32")
    p.add_argument("--gpu-mem", type=_arg_type(_memory_size),
                   help="GPU memory, e.g. 24G (default: the first CUDA device's, if any)")
    p.add_argument("--ram", type=_arg_type(_memory_size), help="host RAM, e.g. 64G (default: this machine's, or "
                   "its container's memory limit where lower)")
    p.add_argument("--disk", metavar="DIR", help="directory on the disk that would hold the swap file: its free "
                   "space, and its bandwidth from a `swapio tune` config there or a short measurement")
    p.add_argument("--buffer-bytes", type=_arg_type(_positive_size), default=fmt(memplan.DEFAULT_BUFFER_BYTES),
                   help="OffloadAdamW's buffer_bytes in nvme mode (default 256M)")
    p.add_argument("--ring-bytes", type=_arg_type(_positive_size), default=None,
                   help="weights offloaded: disk_offload's buffer_bytes (default: --buffer-bytes)")
    p.add_argument("--largest-module", type=_arg_type(_positive_size), default=None,
                   help="weights offloaded: bytes of the largest module's own weights in --dtype, usually the "
                        "embedding (vocab x hidden x 2 for bf16); several pinned buffers are sized to it "
                        "(default: not counted)")
    shape = p.add_argument_group("activations", "with all of --seq, --batch, --hidden and --layers, an activations "
                                 "row: what one forward saves for backward, and where offload_activations puts it")
    shape.add_argument("--seq", type=_int, help="sequence length (tokens)")
    shape.add_argument("--batch", type=_int, help="sequences per forward")
    shape.add_argument("--hidden", type=_int, help="the model's width (hidden size)")
    shape.add_argument("--layers", type=_int, help="transformer layers")
    shape.add_argument("--heads", type=_int, help="attention heads: counts the attention scores that eager "
                       "attention saves (default: none saved, as with flash attention)")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(run=_run_plan)
    return p


def _tune_parser(sub):
    from . import tune
    p = sub.add_parser("tune", help="sweep block size x queue depth x threads x engine; write the best config",
                       description="Finds the fastest AioHandle settings for a disk: a coarse sweep, then a local "
                                   "refinement around the best, then threads, then a re-measured final round. "
                                   "Writes a config for swapio.AioHandle.from_config(FILE).",
                       allow_abbrev=False)
    p.add_argument("--dir", dest="directory", help="directory on the disk to tune (default: .)")
    p.add_argument("--size", type=_size, default=fmt(tune.DEFAULT_SIZE), help="test file size (default 512M)")
    p.add_argument("--rw", type=_list(str), default=["read", "write"], help="read,write (default both)")
    p.add_argument("--engines", type=_list(str), help="engines to try (default: every usable one)")
    p.add_argument("--bs", dest="block_sizes", type=_list(_size), help="block sizes to consider "
                   "(default 64K,128K,256K,512K,1M,2M,4M,8M)")
    p.add_argument("--iodepth", dest="depths", type=_list(_int), help="queue depths (default 1,2,...,128)")
    p.add_argument("--threads", type=_list(_int), help="thread counts (default 1,2,4)")
    p.add_argument("--point-time", type=_duration, default=tune.DEFAULT_POINT_TIME,
                   help="measured seconds per point (default 0.4)")
    p.add_argument("--warmup", type=_duration, default=tune.DEFAULT_WARMUP,
                   help="unmeasured seconds before each point (default 0.1)")
    p.add_argument("--budget", type=_duration, default=tune.DEFAULT_BUDGET,
                   help="stop refining after this long (default 100 s; the final round still runs)")
    _add_direct(p)
    p.add_argument("-o", "--output", help="config file to write (default: swapio-io.json in --dir)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the sweep as heat maps (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    _add_progress(p, "no progress bar, no notes")
    p.set_defaults(run=_run_tune)
    return p


def fmt(n):
    return report.fmt_size(n)


def _info_parser(sub):
    p = sub.add_parser("info", help="what swapio can use here: engines, O_DIRECT, alignment, SIMD, CUDA",
                       allow_abbrev=False)
    p.add_argument("--path", help="a file or directory to probe for O_DIRECT support and alignment")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(run=_run_info)
    return p


def build_parser():
    p = _Parser(prog="swapio", description="swapio: fast tensor swapping between memory and NVMe.",
                allow_abbrev=False)
    from .._version import __version__
    p.add_argument("--version", action="version", version=f"swapio {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{demo,plan,bench,tune,info}")
    _demo_parser(sub)
    _plan_parser(sub)
    _bench_parser(sub)
    _tune_parser(sub)
    _info_parser(sub)
    return p


# --- helpers shared by the commands
def _progress_choice(args):
    """True (--progress), False (-q) or None (swapio._progress decides: stderr a terminal, SWAPIO_PROGRESS)."""
    return True if args.progress else False if args.quiet else None


def _note(args):
    def log(message):
        if not args.quiet:
            print(f"swapio: {message}", file=sys.stderr, flush=True)
    return log


def _check_directory(path, what):
    from .testfile import check_directory
    check_directory(os.path.abspath(path), what)


def _check_output_path(path, what="--output"):
    if not path.strip():
        raise UsageError(f"{what} is empty: name a file")
    if os.path.isdir(path):
        raise UsageError(f"{what} {path} is a directory")
    if os.path.exists(path) and not os.path.isfile(path):
        return  # /dev/null, /dev/stdout, a FIFO: written in place (report.write_text_atomic)
    # a symlink's target is what gets written, through a temporary file in its directory, then renamed
    _check_directory(os.path.dirname(os.path.realpath(path)), f"{what} {path}: directory")


def _emit(text, output):
    if output:
        report.write_text_atomic(output, text + "\n")
    else:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


# --- commands
def _run_bench(args):
    from . import bench
    if args.output is not None:
        _check_output_path(args.output)
    cfg = bench.BenchConfig(rw=args.rw, bs=args.bs, iodepth=args.iodepth, threads=args.threads, size=args.size,
                            engine=args.engine, direct=args.direct, file=args.file, directory=args.directory,
                            runtime=args.runtime, loops=args.loops, warmup=args.warmup, verify=args.verify,
                            compare_fio=args.compare_fio, fio_first=args.fio_first, progress=_progress_choice(args))
    result = bench.run_bench(cfg, log=_note(args))
    text = json.dumps(result.json(), indent=2) if args.json else report.bench_table(result)
    _emit(text, args.output)
    return 0


def _run_tune(args):
    from . import tune, tune_report
    if args.output is None:  # next to the disk it describes, where `swapio plan --disk DIR` looks for it
        args.output = os.path.join(args.directory or ".", tune.CONFIG_NAME)
    if args.directory is not None:
        _check_directory(args.directory, "--dir")
    _check_output_path(args.output)
    if args.plot is not None:
        _check_output_path(args.plot, "--plot")
        tune_report.require_matplotlib()
    cfg = tune.TuneConfig(directory=args.directory, size=args.size, ops=tuple(args.rw),
                          engines=tuple(args.engines) if args.engines else None,
                          block_sizes=tuple(args.block_sizes) if args.block_sizes else tune.BLOCK_SIZES,
                          depths=tuple(args.depths) if args.depths else tune.DEPTHS,
                          threads=tuple(args.threads) if args.threads else tune.THREADS,
                          point_time=args.point_time, warmup=args.warmup, budget=args.budget, direct=args.direct,
                          progress=_progress_choice(args))
    result = tune.run_tune(cfg, log=_note(args))
    tune.write_config(result, args.output)
    if args.plot:
        tune_report.plot(result, args.plot)
    if args.json:
        print(json.dumps(result.json(), indent=2))
        _note(args)(f"wrote {os.path.abspath(args.output)}")
    else:
        print(tune_report.summary(result, os.path.abspath(args.output), args.plot))
    return 0


def _run_demo(args):
    from . import demo
    _check_directory(args.directory, "--dir")
    if args.plot is not None:
        _check_output_path(args.plot, "--plot")
        from .tune_report import require_matplotlib
        require_matplotlib()
    cfg = demo.DemoConfig(steps=args.steps, layers=args.layers, width=args.width, heads=args.heads,
                          context=args.context, batch=args.batch, lr=args.lr, log_every=args.log_every,
                          buffer_bytes=args.buffer_bytes, directory=args.directory, seed=args.seed,
                          optimizer=args.optimizer, progress=_progress_choice(args))
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    result = demo.run_demo(cfg)
    print(demo.report(result))
    if args.plot:
        demo.plot(result, args.plot)
        print(f"\nwrote {os.path.abspath(args.plot)}")
    return 0


def _load_shapes(path):
    """The shapes in a --shapes FILE: a JSON list of shapes, or a dict of name: shape."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise PathError(f"--shapes {path} does not exist") from None
    except IsADirectoryError:
        raise PathError(f"--shapes {path} is a directory, not a JSON file") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise UsageError(f"--shapes {path}: cannot read it as JSON ({e})", prog="swapio plan") from None
    shapes = list(doc.values()) if isinstance(doc, dict) else doc
    if not isinstance(shapes, list):
        raise UsageError(f"--shapes {path} must hold a list of shapes or a dict of name: shape, got a "
                         f"{type(doc).__name__}", prog="swapio plan")
    try:
        return memplan.check_shapes(shapes)
    except ValueError as e:
        raise UsageError(f"--shapes {path}: {e}", prog="swapio plan") from None


def _run_plan(args):
    from . import plan
    if (args.params is None) == (args.shapes is None):
        raise UsageError("give one of --params (a count) and --shapes (a file of the parameters' shapes)",
                         prog="swapio plan")
    shapes = None if args.shapes is None else _load_shapes(args.shapes)
    if args.disk is not None:
        _check_directory(args.disk, "--disk")
    shape = {k: getattr(args, k) for k in ("seq", "batch", "hidden", "layers")}
    given = [k for k, v in shape.items() if v is not None]
    activations = None
    if given or args.heads is not None:
        missing = [f"--{k}" for k, v in shape.items() if v is None]
        if missing:
            raise UsageError(f"the activations row needs --seq, --batch, --hidden and --layers: {', '.join(missing)} "
                             "missing", prog="swapio plan")
        bad = [f"--{k}" for k, v in (*shape.items(), ("heads", args.heads)) if v is not None and v <= 0]
        if bad:
            raise UsageError(f"{', '.join(bad)} must be positive", prog="swapio plan")
        activations = dict(shape, heads=args.heads)
    if args.optimizer == "adafactor" and args.state_dtype != "fp32":
        raise UsageError(f"--optimizer adafactor keeps fp32 state only (its factored moments are already next to "
                         f"nothing): drop --state-dtype {args.state_dtype}")
    gpu_mem, ram = args.gpu_mem, args.ram
    if gpu_mem is None:
        gpu_mem = plan.gpu_memory()
    if ram is None:  # a container's memory limit, where lower than the machine's RAM, is what there is
        from .hostmem import total_bytes
        ram = total_bytes()
    result = plan.run_plan(args.params, args.dtype, args.optimizer, args.state_dtype, gpu_mem, ram, args.disk,
                           args.buffer_bytes, log=_note(argparse.Namespace(quiet=args.json)),
                           ring_bytes=args.ring_bytes, largest_module=args.largest_module or 0,
                           activations=activations, shapes=shapes)
    print(json.dumps(result, indent=2) if args.json else plan.plan_text(result))
    return 0


def _run_info(args):
    from .. import info
    from .info_text import info_text
    if args.path is not None:
        _check_info_path(args.path)
    data = info(args.path)
    print(json.dumps(data, indent=2) if args.json else info_text(data))
    return 0


def _check_info_path(path):
    from .testfile import creation_refused
    if not os.path.exists(path):
        raise PathError(f"--path {path} does not exist")
    if os.path.isfile(path):
        return  # probed in place, read only
    if not os.path.isdir(path):  # the probe would open a FIFO (and wait) or describe the directory holding a device
        raise PathError(f"--path {path} is neither a regular file nor a directory")
    refused = creation_refused(path)  # the O_DIRECT probe of a directory creates a temporary file in it
    if refused:
        raise PathError(f"--path {path} is a directory that is not writable ({refused}); name a file in it instead")


def _one_line(exc):
    if isinstance(exc, OSError):
        msg = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) not in msg:
            msg = f"{msg}: {exc.filename}"
        return msg
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _terminate(signum, frame):
    raise _Terminated()


class _Terminated(BaseException):
    pass


def main(argv=None):
    """Entry point of the `swapio` script; returns the exit status."""
    prog = "swapio"

    def showwarning(message, category, filename, lineno, file=None, line=None):
        print(f"swapio: warning: {message}", file=sys.stderr)

    old_showwarning, old_term = warnings.showwarning, None
    warnings.showwarning = showwarning
    # 1/true/yes/on: tracebacks; 0/false/no/off or unset: one-line errors; another value: a warning, then those
    debug = bool(_env.switch("SWAPIO_DEBUG", "one-line errors, no tracebacks"))
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _terminate)  # cleanup runs on `kill` as on Ctrl-C
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        prog = f"swapio {args.command}"
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see {prog} --help)")
        return args.run(args)
    except UsageError as e:  # PathError included
        print(f"{getattr(e, 'prog', None) or prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return interrupted(prog)
    except _Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except SystemExit:
        raise
    except BrokenPipeError:
        return EXIT_FAILURE
    except Exception as e:  # noqa: BLE001 - the command line shows one line, not a traceback
        if debug:
            raise
        known = _known_errors()
        if isinstance(e, known):
            print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        else:
            print(f"{prog}: internal error: {type(e).__name__}: {_one_line(e)} (SWAPIO_DEBUG=1 shows the "
                  "traceback)", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        warnings.showwarning = old_showwarning
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _known_errors():
    from .errors import ToolError
    return (ToolError, OSError, ValueError, TypeError)


if __name__ == "__main__":
    sys.exit(main())
