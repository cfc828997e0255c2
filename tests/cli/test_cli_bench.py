"""`swapio bench`: JSON fields, the table, time- and size-based runs, --verify, the fio comparison."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import swapio
from swapio.tools import bench, loadgen, pattern
from swapio.tools.report import FIO_PERCENTILES, pct_key

from helpers.cli import assert_one_line_error, leftovers, run_cli

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default temporary files land here


def _bench_json(capsys, tmp_path, *argv):
    out = tmp_path / "out.json"
    where = [] if "--file" in argv else ["--dir", str(tmp_path)]
    rc, stdout, err = run_cli(capsys, "bench", *where, "--json", "-q", "--output", str(out), *argv)
    assert rc == 0, err
    assert stdout == ""  # --output replaces stdout
    doc = json.loads(out.read_text())
    out.unlink()
    return doc


def _check_direction(d, nbytes, bs):
    assert d["io_bytes"] == nbytes and d["io_kbytes"] == nbytes // 1024
    assert d["total_ios"] == nbytes // bs
    assert d["bw_bytes"] > 0 and abs(d["bw"] - d["bw_bytes"] / 1024) <= 1
    assert d["iops"] == pytest.approx(d["bw_bytes"] / bs, rel=1e-3)
    assert d["runtime"] >= 0
    assert d["bw_mib_s"] == pytest.approx(d["bw_bytes"] / MiB, rel=1e-3)
    assert d["bw_gb_s"] == pytest.approx(d["bw_bytes"] / 1e9, rel=1e-3)
    assert 0 <= d["usr_cpu"] and 0 <= d["sys_cpu"]
    for block in ("clat_ns", "lat_ns"):
        lat = d[block]
        assert lat["N"] == d["total_ios"]
        pct = lat["percentile"]
        assert set(pct) == {pct_key(p) for p in FIO_PERCENTILES}
        assert "99.000000" in pct and "99.900000" in pct and "50.000000" in pct
        values = [pct[pct_key(p)] for p in FIO_PERCENTILES]
        assert values == sorted(values)
        assert 0 < lat["min"] <= values[0] and values[-1] <= lat["max"] < 60e9
        assert lat["min"] <= lat["mean"] <= lat["max"] and lat["stddev"] >= 0


def test_default_json_has_every_fio_field_for_write_then_read(capsys, tmp_path):
    doc = _bench_json(capsys, tmp_path, "--size", "4M", "--bs", "256K")
    assert {"swapio version", "timestamp", "time", "jobs"} <= set(doc)
    job = doc["jobs"][0]
    assert job["jobname"] == "swapio" and job["error"] == 0
    for d in ("read", "write"):
        _check_direction(job[d], 4 * MiB, 256 << 10)
    opts = job["job options"]
    assert (opts["rw"], opts["bs"], opts["iodepth"], opts["numjobs"], opts["size"]) == \
        ("rw", str(256 << 10), "32", "1", str(4 * MiB))
    assert opts["ioengine"] in ("uring", "aio", "psync")
    sw = job["swapio"]
    assert sw["phases"] == ["write:write", "read:read"] and sw["temporary"] is True
    assert job["usr_cpu"] >= 0 and job["sys_cpu"] >= 0
    assert leftovers(tmp_path) == []  # the temporary file is gone


def test_randread_time_based_fills_read_and_zeroes_write(capsys, tmp_path):
    doc = _bench_json(capsys, tmp_path, "--rw", "randread", "--bs", "4K", "--iodepth", "16", "--size", "4M",
                      "--runtime", "0.3", "--warmup", "0.1")
    job = doc["jobs"][0]
    r = job["read"]
    assert r["total_ios"] > 0 and r["io_bytes"] == r["total_ios"] * 4096
    assert r["clat_ns"]["N"] == r["total_ios"]
    assert r["runtime"] >= 300  # the window lasts --runtime after the warmup, however slow its tail
    assert job["write"]["io_bytes"] == 0 and job["write"]["clat_ns"]["N"] == 0
    assert job["job options"]["time_based"] == "1" and job["job options"]["ramp_time"] == "0.1"


def test_loops_and_threads_and_named_file_is_kept(capsys, tmp_path):
    f = tmp_path / "data.bin"
    doc = _bench_json(capsys, tmp_path, "--file", str(f), "--rw", "write", "--size", "2M", "--bs", "128K",
                      "--loops", "2", "--threads", "2")
    _check_direction(doc["jobs"][0]["write"], 4 * MiB, 128 << 10)
    assert f.stat().st_size == 2 * MiB  # --file stays, like fio
    doc = _bench_json(capsys, tmp_path, "--file", str(f), "--rw", "read", "--size", "2M", "--bs", "64K",
                      "--buffered", "--engine", "psync")
    _check_direction(doc["jobs"][0]["read"], 2 * MiB, 64 << 10)
    assert doc["jobs"][0]["job options"]["direct"] == "0"


def test_table_output(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "bench", "--size", "2M", "--bs", "128K", "-q")
    assert rc == 0, err
    assert "sequential write then read" in out and "MiB/s" in out and "GB/s" in out and "p99.9" in out
    lines = out.splitlines()
    assert any(line.startswith("write ") for line in lines) and any(line.startswith("read ") for line in lines)
    assert leftovers(tmp_path) == []


def test_progress_bar_path_runs(tmp_path, capsys):
    cfg = bench.BenchConfig(rw="write", size=2 * MiB, bs=128 << 10, directory=str(tmp_path), progress=True,
                            runtime=0.2)
    assert bench.run_bench(cfg).phases[0].bytes > 0


# --- --verify
def _corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


def test_verify_catches_a_corrupted_byte(capsys, tmp_path):
    f = tmp_path / "v.bin"
    rc, out, err = run_cli(capsys, "bench", "--rw", "write", "--verify", "--file", str(f), "--size", "4M",
                           "--bs", "256K", "-q")
    assert rc == 0, err
    assert "verify: passed" in out
    bench.verify_file(str(f), 4 * MiB)  # the pattern reads back clean
    _corrupt(f, 1234567)
    with pytest.raises(bench.VerifyError) as e:
        bench.verify_file(str(f), 4 * MiB)
    assert e.value.offset == 1234567
    rc, _, err = run_cli(capsys, "bench", "--rw", "read", "--verify", "--file", str(f), "--size", "4M",
                         "--bs", "256K", "-q")
    assert_one_line_error(rc, err, "verify failed", "1234567")
    assert f.exists()  # a named file that existed before is never removed


def test_verify_catches_corruption_between_write_and_read(tmp_path):
    hit = []

    def corrupt(label, path):
        if label == "write":
            _corrupt(path, 3 * MiB + 8)
            hit.append(path)

    cfg = bench.BenchConfig(rw="rw", size=4 * MiB, bs=512 << 10, directory=str(tmp_path), verify=True)
    with pytest.raises(bench.VerifyError) as e:
        bench.run_bench(cfg, after_phase=corrupt)
    assert e.value.offset == 3 * MiB + 8
    assert hit and not os.path.exists(hit[0])  # the temporary file went on error


@pytest.mark.parametrize("rw", ["randread", "randwrite"])
def test_random_verify_passes(capsys, tmp_path, rw):
    rc, out, err = run_cli(capsys, "bench", "--rw", rw, "--verify", "--bs", "4K", "--iodepth", "8",
                           "--size", "2M", "--runtime", "0.2", "-q")
    assert rc == 0, err
    assert "verify: passed" in out


def test_random_write_verify_on_an_existing_file_lays_the_pattern_out_first(capsys, tmp_path):
    # random writes touch some pieces, and the check reads the whole file back: on a --file that held anything but
    # the pattern it reported "verify failed" at the first piece the run had not written, a corruption that was not
    f = tmp_path / "existing.bin"
    f.write_bytes(b"\xff" * (2 * MiB))
    for _ in range(2):  # and again on the file the first run left
        rc, out, err = run_cli(capsys, "bench", "--rw", "randwrite", "--verify", "--file", str(f), "--bs", "4K",
                               "--iodepth", "8", "--size", "2M", "--loops", "1", "-q")
        assert rc == 0, err
        assert "verify: passed (2 MiB checked)" in out
    bench.verify_file(str(f), 2 * MiB)


@pytest.mark.parametrize("rw", ["write", "rw"])
def test_time_based_write_verify_ending_before_a_whole_pass(capsys, tmp_path, monkeypatch, rw):
    # 1 MiB requests (64K x 4 in flight) over 32 MiB, for 1 ms: the run writes a few MiB, and the check read the
    # rest, never written, and reported "verify failed" (rw: its read pass could read past what was written)
    monkeypatch.setattr(loadgen, "SEQ_REQUEST", MiB)
    rc, out, err = run_cli(capsys, "bench", "--rw", rw, "--verify", "--size", "32M", "--bs", "64K", "--iodepth", "4",
                           "--runtime", "1ms", "-q")
    assert rc == 0, err
    assert "verify: passed (32 MiB checked)" in out
    assert leftovers(tmp_path) == []


def test_random_offsets_match_the_native_core(tmp_path):
    bs, blocks, count, seed = 4096, 256, 300, 12345
    path = str(tmp_path / "r.bin")
    data = torch.arange(blocks, dtype=torch.int64).repeat_interleave(bs // 8)  # each block holds its index
    with swapio.AioHandle(block_size=bs, queue_depth=8, direct=False) as h:
        h.pwrite(data, path).wait(timeout=30)
        buf = torch.zeros(count * bs // 8, dtype=torch.int64)
        req = h._native.submit_random("read", buf.data_ptr(), buf.numel() * 8, path, blocks * bs, count, seed)
        assert req.wait(30)
        req.result()
    got = buf.view(count, bs // 8)[:, 0].numpy()
    want = pattern.random_offsets(seed, count, blocks * bs, bs) // np.uint64(bs)
    assert (got == want.astype(np.int64)).all()


# --- --compare-fio
@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_compare_fio_reports_both_and_ratios(capsys, tmp_path):
    doc = _bench_json(capsys, tmp_path, "--rw", "read", "--size", "4M", "--bs", "256K", "--compare-fio")
    fio = doc["fio"]
    assert fio["version"].startswith("fio")
    assert len(fio["commands"]) == 1 and "--rw=read" in fio["commands"][0]
    theirs = fio["phases"]["read:read"]["job"]["read"]
    assert theirs["io_bytes"] == 4 * MiB and theirs["bw_bytes"] > 0
    r = fio["ratios"]["read"]
    assert r["bw"] > 0 and r["iops"] > 0 and r["lat_p99"] > 0
    assert leftovers(tmp_path) == []


def test_compare_fio_without_fio_says_how_to_install(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rc, _, err = run_cli(capsys, "bench", "--size", "2M", "--compare-fio", "-q")
    assert_one_line_error(rc, err, "fio is not installed", "apt-get install fio")
    assert leftovers(tmp_path) == []
