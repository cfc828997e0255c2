"""swapio command line: size/duration parsing and flag handling (no I/O)."""
import pytest

from swapio.tools import cli
from swapio.tools.report import fmt_size, parse_duration, parse_size


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("4k", 4 << 10), ("4K", 4 << 10), ("128KiB", 128 << 10), ("128KB", 128 << 10),
    ("1M", 1 << 20), ("1m", 1 << 20), ("2G", 2 << 30), ("1.5G", 3 << 29), ("1T", 1 << 40), (" 8M ", 8 << 20)])
def test_parse_size_takes_fio_style_suffixes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12X", "", "-1", "1.3K", "M", "1 M B", "0x10"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text, seconds", [("10", 10.0), ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0),
                                           ("0.25", 0.25)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_fmt_size_round_trips():
    for n in (512, 4096, 128 << 10, 1 << 20, 3 << 30, 1000):
        assert parse_size(fmt_size(n)) == n


def _bench_args(*argv):
    args, extra = cli.build_parser().parse_known_args(["bench", *argv])
    assert not extra
    return args


def test_bench_defaults_are_a_sequential_write_then_read_of_1g_at_1m_qd32():
    a = _bench_args()
    assert (a.rw, a.bs, a.iodepth, a.threads, a.size, a.engine, a.direct, a.loops, a.runtime) == \
        ("rw", 1 << 20, 32, 1, 1 << 30, "auto", None, 1, None)
    assert a.file is None and a.directory is None and not a.verify and not a.json


def test_bench_flags_in_fio_vocabulary():
    a = _bench_args("--rw", "randread", "--bs", "4k", "--iodepth", "64", "--numjobs", "2", "--size", "2G",
                    "--engine", "aio", "--direct", "--dir", "/tmp", "--runtime", "10s", "--warmup", "1",
                    "--verify", "--json", "--output", "x.json", "--quiet", "--compare-fio")
    assert (a.rw, a.bs, a.iodepth, a.threads, a.size, a.engine, a.direct) == \
        ("randread", 4096, 64, 2, 2 << 30, "aio", True)
    assert (a.directory, a.runtime, a.warmup, a.verify, a.json, a.output, a.quiet, a.compare_fio) == \
        ("/tmp", 10.0, 1.0, True, True, "x.json", True, True)
    assert _bench_args("--buffered").direct is False
    assert _bench_args("--threads", "3").threads == 3


def test_tune_lists():
    a, _ = cli.build_parser().parse_known_args(["tune", "--bs", "64K,1M", "--iodepth", "1,8", "--engines",
                                                "uring,psync", "--threads", "1,2", "--rw", "read"])
    assert a.block_sizes == [64 << 10, 1 << 20] and a.depths == [1, 8] and a.threads == [1, 2]
    assert a.engines == ["uring", "psync"] and a.rw == ["read"]


@pytest.mark.parametrize("text, value", [("8", 8), ("08", 8), ("010", 10), (" 32 ", 32), ("+4", 4)])
def test_counts_are_decimal_leading_zeros_included(text, value):
    # "--iodepth 010" was refused as "not a whole number" (Python's base-0 parsing takes no leading zero), and
    # "0x10" taken as 16 where sizes refuse hex
    assert _bench_args("--iodepth", text).iodepth == value


@pytest.mark.parametrize("text", ["0x10", "1.5", "eight", ""])
def test_counts_refuse_anything_but_a_decimal_whole_number(capsys, text):
    rc = cli.main(["bench", "--iodepth", text])
    err = capsys.readouterr().err
    assert rc == 2 and f"{text!r} is not a whole number" in err


@pytest.mark.parametrize("argv, needle", [(["bench", "--size", "-1M"], "--size: '-1M': a size cannot be negative"),
                                          (["bench", "--bs", "-4K"], "--bs: '-4K': a size cannot be negative"),
                                          (["bench", "--runtime", "-2s"], "a duration cannot be negative"),
                                          (["bench", "--iodepth", "-3"], "--iodepth must be between 1 and"),
                                          (["plan", "--params", "7B", "--ram", "-64G"], "cannot be negative")])
def test_negative_values_are_named_as_such(capsys, argv, needle):
    # `--size -1M` read "-1M" as an unknown option: "argument --size: expected one argument"
    rc = cli.main([*argv, "-q"] if argv[0] == "bench" else argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, needle", [(["plan", "--params", "1e400"], "too large a parameter count"),
                                          (["bench", "--size", "9" * 400 + "P"], "too large a size"),
                                          (["bench", "--runtime", "9" * 400], "too long a duration")])
def test_numbers_beyond_a_float_are_usage_errors(capsys, argv, needle):
    # float() made them inf: "internal error: OverflowError" (exit 1) for --params and --size, and a --runtime
    # of inf seconds that never ended
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "internal error" not in err, err
