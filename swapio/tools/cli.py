"""The `swapio` command (also `python -m swapio`): bench, tune, info.

Errors are one line on stderr and a non-zero exit status (2: bad usage, 1: failure, 130: interrupted);
set SWAPIO_DEBUG=1 to get Python tracebacks instead.
"""
import argparse
import json
import os
import signal
import sys
import threading
import warnings

from .. import _C

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


class UsageError(Exception):
    def __init__(self, message, prog=None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def _size(text):
    from .report import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _duration(text):
    from .report import parse_duration
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int(text):
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _list(convert):
    def parse(text):
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} is an empty list")
        return [convert(t.strip()) for t in items]
    return parse


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
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no notes")
    p.set_defaults(run=_run_bench)
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
    p.add_argument("-o", "--output", default="swapio-io.json",
                   help="config file to write (default swapio-io.json)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the sweep as heat maps (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=_run_tune)
    return p


def fmt(n):
    from .report import fmt_size
    return fmt_size(n)


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
    from .. import __version__
    p.add_argument("--version", action="version", version=f"swapio {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{bench,tune,info}")
    _bench_parser(sub)
    _tune_parser(sub)
    _info_parser(sub)
    return p


# --- helpers shared by the commands
def _progress_wanted(args):
    return not args.quiet and sys.stderr.isatty()


def _note(args):
    def log(message):
        if not args.quiet:
            print(f"swapio: {message}", file=sys.stderr, flush=True)
    return log


def _check_output_path(path, what="--output"):
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{what} {path}: directory {directory} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{what} {path} is a directory")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{what} {path}: directory {directory} is not writable")


def _emit(text, output):
    if output:
        from .report import write_text_atomic
        write_text_atomic(output, text + "\n")
    else:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


# --- commands
def _run_bench(args):
    from . import bench, report
    if args.output:
        _check_output_path(args.output)
    cfg = bench.BenchConfig(rw=args.rw, bs=args.bs, iodepth=args.iodepth, threads=args.threads, size=args.size,
                            engine=args.engine, direct=args.direct, file=args.file, directory=args.directory,
                            runtime=args.runtime, loops=args.loops, warmup=args.warmup, verify=args.verify,
                            compare_fio=args.compare_fio, fio_first=args.fio_first, progress=_progress_wanted(args))
    result = bench.run_bench(cfg, log=_note(args))
    text = json.dumps(result.json(), indent=2) if args.json else report.bench_table(result)
    _emit(text, args.output)
    return 0


def _run_tune(args):
    from . import tune
    _check_output_path(args.output)
    if args.plot:
        _check_output_path(args.plot, "--plot")
        tune.require_matplotlib()
    cfg = tune.TuneConfig(directory=args.directory, size=args.size, ops=tuple(args.rw),
                          engines=tuple(args.engines) if args.engines else None,
                          block_sizes=tuple(args.block_sizes) if args.block_sizes else tune.BLOCK_SIZES,
                          depths=tuple(args.depths) if args.depths else tune.DEPTHS,
                          threads=tuple(args.threads) if args.threads else tune.THREADS,
                          point_time=args.point_time, warmup=args.warmup, budget=args.budget, direct=args.direct,
                          progress=not args.quiet)
    result = tune.run_tune(cfg, log=_note(args))
    tune.write_config(result, args.output)
    if args.plot:
        tune.plot(result, args.plot)
    if args.json:
        print(json.dumps(result.json(), indent=2))
    else:
        print(tune.summary(result, args.output, args.plot))
    return 0


def _run_info(args):
    from .. import info
    from .info_text import info_text
    if args.path is not None and not os.path.exists(args.path):
        raise UsageError(f"--path {args.path} does not exist")
    data = info(args.path)
    print(json.dumps(data, indent=2) if args.json else info_text(data))
    return 0


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
    debug = bool(os.environ.get("SWAPIO_DEBUG"))

    def showwarning(message, category, filename, lineno, file=None, line=None):
        print(f"swapio: warning: {message}", file=sys.stderr)

    old_showwarning, old_term = warnings.showwarning, None
    warnings.showwarning = showwarning
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
    except UsageError as e:
        print(f"{e.prog or prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
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
