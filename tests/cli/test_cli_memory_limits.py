"""Settings that need more host memory than the machine has are refused up front: exit 2 and one line, no file
left. (`swapio demo --batch 100000000` ground for ten minutes before the OOM killer ended it, exit 137, leaving its
swap directory; `swapio bench --bs 1G --iodepth 32` asked for 32 GiB of pinned buffers.) The tests shrink the
memory the tools see as available rather than asking for more than this machine has."""
import json
import os

import pytest

from swapio.tools import demo, demo_model, hostmem

from helpers.cli import assert_one_line_error, leftovers, run_cli

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def available_32_mib(monkeypatch):
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 32 * MiB)


def test_available_memory_is_read_from_the_system():
    avail = hostmem.available_bytes()
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert avail is not None and 0 < avail <= total


@pytest.mark.parametrize("argv", [["--rw", "write"], ["--rw", "read"], ["--rw", "randread", "--bs", "64K",
                                                                        "--iodepth", "1024"]])
def test_bench_buffers_larger_than_memory_are_refused(capsys, tmp_path, available_32_mib, argv):
    # 1M x 64 in flight = 64 MiB of buffers; randread 64K x 1024 the same
    rc, _, err = run_cli(capsys, "bench", "-q", "--size", "64M", "--bs", "1M", "--iodepth", "64", *argv)
    assert_one_line_error(rc, err, "swapio bench: error:", "64 MiB of memory", "32 MiB available", "--iodepth")
    assert rc == 2
    assert leftovers(tmp_path) == []


def test_bench_within_memory_runs(capsys, tmp_path, available_32_mib):
    rc, _, err = run_cli(capsys, "bench", "-q", "--size", "4M", "--bs", "256K", "--iodepth", "4", "--verify")
    assert rc == 0, err
    assert leftovers(tmp_path) == []


def test_demo_larger_than_memory_is_refused(capsys, tmp_path, available_32_mib):
    argv = ["--layers", "1", "--width", "32", "--heads", "2", "--batch", "64", "--context", "256", "--steps", "1"]
    cfg = demo.DemoConfig(layers=1, width=32, heads=2, batch=64, context=256)
    assert demo.memory_bytes(cfg) > 32 * MiB  # the logits alone: 16384 tokens x 256 x 4 bytes = 16 MiB
    rc, _, err = run_cli(capsys, "demo", "-q", *argv)
    assert_one_line_error(rc, err, "swapio demo: error:", "32 MiB available", "--batch 64")
    assert rc == 2
    assert leftovers(tmp_path) == []


def test_demo_memory_estimate_counts_every_parameter_of_its_model():
    """At least what the four models hold (the base and three trained: weights, three gradients, two optimizers'
    fp32 moments: 44 bytes a parameter), counted from the model itself."""
    for cfg in (demo.DemoConfig(), demo.DemoConfig(layers=2, width=32, heads=2, context=16)):
        model = demo_model.TinyGPT(cfg.layers, cfg.width, cfg.heads, cfg.context)
        params = sum(p.numel() for p in model.parameters())
        activations = 4 * cfg.batch * cfg.context * 256  # the logits, at least
        assert demo.memory_bytes(cfg) >= 44 * params + activations


def test_plan_counts_a_containers_memory_limit_as_its_ram(capsys, tmp_path, monkeypatch):
    # plan took the machine's RAM: in a container limited to 1 GiB on a large host, "RAM ... yes" and then the OOM
    (tmp_path / "cgroup").mkdir()
    (tmp_path / "cgroup" / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "cgroup" / "memory.current").write_text(f"{100 << 20}\n")
    monkeypatch.setattr(hostmem, "CGROUP", str(tmp_path / "cgroup"))
    rc, out, err = run_cli(capsys, "plan", "--params", "1B", "--json")
    assert rc == 0, err
    assert json.loads(out)["capacity"]["ram"] == 1 << 30
    assert hostmem.available_bytes() <= (1 << 30) - (100 << 20)
    (tmp_path / "cgroup" / "memory.max").write_text("max\n")  # no limit: the machine's RAM
    rc, out, _ = run_cli(capsys, "plan", "--params", "1B", "--json")
    assert json.loads(out)["capacity"]["ram"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
