"""`swapio tune` on a tiny sweep: the config it writes loads with AioHandle.from_config; --plot draws a PNG."""
import json
import struct

import pytest

import swapio
from swapio.tools import cli

from helpers.cli import leftovers, run_cli

try:
    import matplotlib  # noqa: F401
    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    cfg, png = d / "swapio-io.json", d / "sweep.png"
    argv = ["tune", "--dir", str(d), "--size", "4M", "--bs", "64K,128K", "--iodepth", "1,4", "--threads", "1,2",
            "--engines", "uring" if swapio.info()["engines"]["uring"] == "ok" else "psync",
            "--point-time", "0.05", "--warmup", "0", "-o", str(cfg), "-q"]
    if HAVE_MPL:
        argv += ["--plot", str(png)]
    rc = cli.main(argv)
    return rc, d, cfg, png


@pytest.mark.slow
def test_tune_writes_a_config_that_from_config_loads(sweep, capsys):
    rc, d, cfg, _ = sweep
    assert rc == 0
    doc = json.loads(cfg.read_text())
    with swapio.AioHandle.from_config(str(cfg)) as h:
        assert h.block_size in (64 << 10, 128 << 10) and h.queue_depth in (1, 4) and h.threads in (1, 2)
    for op in ("read", "write"):
        with swapio.AioHandle.from_config(doc[op]) as h:
            assert h.block_size in (64 << 10, 128 << 10)
        assert doc["measured"]["best"][op]["gb_s"] > 0
    assert doc["measured"]["sweep"] and doc["measured"]["seconds"] > 0
    assert sorted(f.name for f in d.iterdir()) == sorted(f for f in ("swapio-io.json", "sweep.png")
                                                            if (d / f).exists())  # no test file left


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (pip install 'swapio[plot]')")
def test_tune_plot_writes_a_png(sweep):
    rc, _, _, png = sweep
    assert rc == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 300 and height >= 200 and len(data) > 5000


def test_tune_summary_prints_best_for_read_write_and_both(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "tune", "--dir", str(tmp_path), "--size", "2M", "--bs", "128K",
                           "--iodepth", "2", "--threads", "1", "--engines", "psync", "--point-time", "0.03",
                           "--warmup", "0", "-o", str(tmp_path / "c.json"), "-q")
    assert rc == 0, err
    for word in ("read ", "write ", "both ", "from_config"):
        assert word in out
    assert leftovers(tmp_path) == ["c.json"]


def test_tune_takes_a_repeated_direction_or_engine_once(capsys, tmp_path):
    # `--rw read,read --engines psync,psync` swept everything twice into the same points and printed the read row
    # twice, a "read GB/s" column twice and a "both" row for one direction
    cfg = tmp_path / "c.json"
    rc, out, err = run_cli(capsys, "tune", "--dir", str(tmp_path), "--size", "2M", "--bs", "128K", "--iodepth", "2",
                           "--threads", "1", "--engines", "psync,psync", "--rw", "read,read", "--point-time",
                           "0.02", "--warmup", "0", "-o", str(cfg), "-q")
    assert rc == 0, err
    rows = [line.split()[0] for line in out.splitlines()[3:] if line.strip() and not line.startswith(("GB/s", "wrote"))]
    assert rows == ["read"], out
    assert out.count("read GB/s") == 1 and "engines psync)" in out
    doc = json.loads(cfg.read_text())
    assert set(doc) == {"handle", "read", "measured"}
    (point,) = doc["measured"]["sweep"]
    assert len(point["gb_s"]) == 1 + 2  # coarse once, then the final round's two measurements
