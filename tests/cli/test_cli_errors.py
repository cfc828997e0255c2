"""Bad input: one line on stderr naming the problem, a non-zero exit, no traceback, no file left behind."""
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from helpers.cli import assert_one_line_error, leftovers, run_cli


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


BAD_BENCH = [
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--bs", "12X"], "cannot parse '12X'"),
    (["--size", "lots"], "argument --size"),
    (["--iodepth", "many"], "argument --iodepth"),
    (["--rw", "sideways"], "invalid choice"),
    (["--engine", "carrier-pigeon"], "invalid choice"),
    (["--bs", "1000", "--size", "1000000", "--direct"], "alignment"),
    (["--bs", "1000", "--size", "1000000"], "alignment"),
    (["--iodepth", "0"], "--iodepth"),
    (["--threads", "0"], "--threads"),
    (["--size", "1M", "--bs", "4M"], "at least --bs"),
    (["--size", "3M", "--bs", "2M"], "multiple of --bs"),
    (["--runtime", "0"], "--runtime"),
    (["--runtime", "1", "--loops", "2"], "not allowed with"),
    (["--file", "f", "--dir", "."], "not allowed with"),
    (["--direct", "--buffered"], "not allowed with"),
    (["--dir", "/nonexistent/swapio"], "does not exist"),
    (["--verify", "--buffered", "--bs", "12", "--size", "1200"], "multiple of 8"),
    (["--fio-first"], "--compare-fio"),
    (["--output", "/nonexistent/dir/out.json"], "does not exist"),
    (["--size", "0"], "--size"),
    (["--bs", "0"], "--bs"),
    (["--loops", "0"], "--loops"),
    (["--warmup", "-1"], "--warmup"),
]


@pytest.mark.parametrize("argv, needle", BAD_BENCH, ids=[" ".join(a) for a, _ in BAD_BENCH])
def test_bad_bench_input(capsys, tmp_path, argv, needle):
    rc, out, err = run_cli(capsys, "bench", "-q", *argv)
    assert_one_line_error(rc, err, needle)
    assert err.startswith("swapio bench: error:")
    assert rc == 2  # bad usage, as docs/cli.md says (it was 1 for errors found after parsing)
    assert leftovers(tmp_path) == []


def test_file_that_is_a_directory(capsys, tmp_path):
    (tmp_path / "d").mkdir()
    rc, _, err = run_cli(capsys, "bench", "-q", "--file", str(tmp_path / "d"), "--size", "1M")
    assert_one_line_error(rc, err, "not a regular file")
    assert rc == 2


def test_reading_a_short_existing_file_leaves_it_alone(capsys, tmp_path):
    f = tmp_path / "short.bin"
    f.write_bytes(b"x" * 4096)
    rc, _, err = run_cli(capsys, "bench", "-q", "--rw", "read", "--file", str(f), "--size", "1M")
    assert_one_line_error(rc, err, "fewer than --size")
    assert rc == 2
    assert f.read_bytes() == b"x" * 4096


def test_new_named_file_is_removed_when_the_run_fails(capsys, tmp_path):
    f = tmp_path / "new.bin"
    rc, _, err = run_cli(capsys, "bench", "-q", "--file", str(f), "--bs", "1000", "--size", "1000000")
    assert_one_line_error(rc, err, "alignment")
    assert not f.exists()


def test_io_error_mid_run_cleans_up(capsys, tmp_path):
    """Writes past RLIMIT_FSIZE fail with EFBIG, like a disk that fills up during the run."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
    try:
        rc, _, err = run_cli(capsys, "bench", "-q", "--rw", "write", "--size", "4M", "--bs", "256K")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert_one_line_error(rc, err, "swapio bench: error:", "too large")
    assert rc == 1
    assert leftovers(tmp_path) == []


@contextlib.contextmanager
def _mount_tmpfs(path, options, fstype="tmpfs"):
    path.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(path)], capture_output=True)
    except OSError:
        proc = None
    if proc is None or proc.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_not_enough_space(capsys, tmp_path):
    with _mount_tmpfs(tmp_path / "small", "size=2M") as d:
        rc, _, err = run_cli(capsys, "bench", "-q", "--dir", str(d), "--size", "8M")
        assert_one_line_error(rc, err, "not enough free space")
        assert rc == 1  # the disk's failure, not the command line's
        assert leftovers(d) == []


def test_file_through_a_dangling_symlink_creates_its_target(capsys, tmp_path):
    # it failed with "File exists" (creating the link's name, exclusively), exit 1; a shell's > creates the target
    (tmp_path / "data").mkdir()
    link = tmp_path / "bench.bin"
    link.symlink_to(tmp_path / "data" / "f.bin")
    rc, _, err = run_cli(capsys, "bench", "-q", "--rw", "write", "--file", str(link), "--size", "1M", "--bs", "256K")
    assert rc == 0, err
    assert link.is_symlink() and (tmp_path / "data" / "f.bin").stat().st_size == 1 << 20


def test_file_through_a_symlink_is_checked_on_its_targets_disk(capsys, tmp_path):
    # the free space was that of the link's directory: the run started and failed on ENOSPC halfway, exit 1,
    # having overwritten the first MiB of the file
    with _mount_tmpfs(tmp_path / "small", "size=2M") as d:
        target = d / "f.bin"
        target.write_bytes(b"x" * 4096)
        link = tmp_path / "bench.bin"
        link.symlink_to(target)
        rc, _, err = run_cli(capsys, "bench", "-q", "--rw", "write", "--file", str(link), "--size", "8M")
        assert_one_line_error(rc, err, f"not enough free space in {d}")
        assert rc == 1
        assert target.read_bytes() == b"x" * 4096 and link.is_symlink()


def test_bench_runs_on_ramfs_which_reports_no_free_space(capsys, tmp_path):
    # ramfs keeps no block count (statvfs says 0 blocks, 0 free): that is no limit, not a full disk
    with _mount_tmpfs(tmp_path / "ram", "mode=0755", fstype="ramfs") as d:
        rc, out, err = run_cli(capsys, "bench", "-q", "--dir", str(d), "--size", "1M", "--bs", "256K", "--verify")
        assert rc == 0, err
        assert "verify: passed (1 MiB checked)" in out
        assert leftovers(d) == []


def test_plan_on_ramfs_says_its_free_space_is_unknown_not_too_small(capsys, tmp_path):
    with _mount_tmpfs(tmp_path / "ram", "mode=0755", fstype="ramfs") as d:
        assert os.statvfs(d).f_blocks == 0  # what ramfs reports: no block count
        (d / "swapio-io.json").write_text(json.dumps(  # measured bandwidth, so plan runs no bench
            {"handle": {}, "measured": {"directory": str(d), "both": {"read_gb_s": 2.0, "write_gb_s": 1.0}}}))
        rc, out, err = run_cli(capsys, "plan", "--params", "1B", "--gpu-mem", "80G", "--ram", "1T", "--disk", str(d))
        assert rc == 0, err
        rows = [line for line in out.splitlines() if "(state on disk)" in line]
        assert rows and all(line.endswith("(disk free space unknown)") for line in rows), out
        assert "too small" not in out
        rc, out, _ = run_cli(capsys, "plan", "--params", "1B", "--disk", str(d), "--json")
        assert rc == 0 and json.loads(out)["capacity"]["disk_free"] is None


def test_plan_on_a_disk_too_small_to_measure_still_plans(capsys, tmp_path):
    # 2 MiB free: the 256 MiB bandwidth measurement cannot run there, and the plan is what was asked for (it failed
    # with "not enough free space ... use a smaller --size", an option plan does not have)
    with _mount_tmpfs(tmp_path / "small", "size=2M") as d:
        rc, out, err = run_cli(capsys, "plan", "--params", "1B", "--gpu-mem", "80G", "--ram", "1T", "--disk", str(d))
        assert rc == 0, err
        assert "--size" not in out + err
        assert f"nvme step time: not measured: {d} has 2.0 MiB free" in out
        rows = [line for line in out.splitlines() if "(state on disk)" in line]
        assert rows and all(line.endswith("no: disk too small") for line in rows), out
        rc, out, _ = run_cli(capsys, "plan", "--params", "1B", "--disk", str(d), "--json")
        doc = json.loads(out)
        assert rc == 0 and doc["nvme_step_seconds"] is None and doc["disk"]["read_bytes_per_s"] is None
        assert doc["disk"]["bandwidth_from"].startswith("not measured")
        assert leftovers(d) == []


def test_directory_not_writable(capsys, tmp_path):
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir(mode=0o500)
        ctx = contextlib.nullcontext(d)
    else:  # root writes through permission bits: use a read-only mount
        ctx = _mount_tmpfs(tmp_path / "ro", "ro,size=1M")
    with ctx as d:
        rc, _, err = run_cli(capsys, "bench", "-q", "--dir", str(d), "--size", "1M")
        assert_one_line_error(rc, err, "not writable")
        assert rc == 2
        rc, _, err = run_cli(capsys, "info", "--path", str(d))  # its probe needs to create a file there
        assert_one_line_error(rc, err, "not writable")
        assert rc == 2


BAD_TUNE = [
    (["--engines", "nosuch"], "unknown engine"),
    (["--bs", "12X"], "cannot parse"),
    (["--iodepth", "0"], "--iodepth"),
    (["--rw", "sideways"], "--rw"),
    (["--dir", "/nonexistent/swapio"], "does not exist"),
    (["--point-time", "0"], "--point-time"),
    (["--size", "0"], "--size"),
    (["--threads", "0"], "--threads"),
    # null moves no data: its figures would become the disk's config (from_config: writes that go nowhere)
    (["--engines", "null", "--size", "1M", "--point-time", "10ms", "--warmup", "0"], "engine null moves no data"),
    (["--engines", "uring,null", "--size", "1M", "--point-time", "10ms", "--warmup", "0"], "engine null"),
]


@pytest.mark.parametrize("argv, needle", BAD_TUNE, ids=[" ".join(a) for a, _ in BAD_TUNE])
def test_bad_tune_input(capsys, tmp_path, argv, needle):
    rc, _, err = run_cli(capsys, "tune", "-q", "-o", str(tmp_path / "cfg.json"), *argv)
    assert_one_line_error(rc, err, needle)
    assert rc == 2
    assert leftovers(tmp_path) == []


def test_tune_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, _, err = run_cli(capsys, "tune", "-q", "-o", str(tmp_path / "c.json"), "--plot", str(tmp_path / "p.png"))
    assert_one_line_error(rc, err, "pip install")
    assert leftovers(tmp_path) == []


def test_no_command_prints_help_and_fails(capsys):
    rc, _, err = run_cli(capsys)
    assert rc == 2 and "bench" in err and "Traceback" not in err
