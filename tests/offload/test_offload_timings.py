"""Where weight offload's time goes: swapio.offload.stats(model) says where forwards spent their
time (waiting for weights against computing, bytes read, GB/s) and resets; a torch.profiler trace shows the
fetches by name; disk_offload(offload_dir=...) draws a progress bar of the weights it writes when asked."""
import os

import pytest
import torch

import swapio._progress as _progress
from swapio.offload import cpu_offload, disk_offload, remove_offload, stats
from swapio.offload.api import _offloaded

WIDTH, DEPTH = 256, 4
TIMES = ("forward_s", "wait_s", "compute_s")


def mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]
    return torch.nn.Sequential(*layers).requires_grad_(False)


def offloaded(kind, tmp_path, **kwargs):
    if kind == "disk":
        return disk_offload(mlp(), tmp_path / "od", **kwargs)
    return cpu_offload(mlp(), **kwargs)


@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_stats_split_forward_time_into_waits_and_compute_and_reset(tmp_path, kind):
    model = offloaded(kind, tmp_path)
    x = torch.randn(2, WIDTH)
    try:
        assert stats(model, reset=True)["forward_s"] == 0  # no forward ran since offloading
        zero = stats(model)
        assert all(zero[k] == 0 for k in ("reads", "bytes_read", "copies", "refetches", *TIMES, "read_gbps"))
        with torch.no_grad():
            for _ in range(3):
                model(x)
        s = stats(model)
        assert s["forward_s"] > 0
        assert 0 <= s["wait_s"] <= s["forward_s"]  # the waits happen inside the forwards, on the same clock
        assert s["compute_s"] == pytest.approx(s["forward_s"] - s["wait_s"])
        if kind == "disk":
            weights = sum(p.numel() * 4 for p in mlp().parameters())
            assert s["bytes_read"] >= 3 * weights  # released weights are read again by each forward
            assert s["read_gbps"] == pytest.approx(s["bytes_read"] / s["forward_s"] / 1e9)
        else:
            assert s["bytes_read"] == 0 and s["read_gbps"] == 0
    finally:
        remove_offload(model)


class Scaled(torch.nn.Module):
    """A unit of its own (`scale`) whose forward runs another unit (`inner`)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.inner = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.inner(x) * self.scale


def test_nested_offloaded_forwards_are_timed_once(tmp_path):
    """forward_s is the outermost forwards' wall time: a unit inside another does not add its time again."""
    model = disk_offload(Scaled().requires_grad_(False), tmp_path / "od")
    engine = _offloaded[model]
    calls = []
    real_ends = engine.forward_ends
    engine.forward_ends = lambda start: (calls.append(start), real_ends(start))[1]
    try:
        with torch.no_grad():
            model(torch.randn(2, WIDTH))
        assert len(engine.units) == 2 and len(calls) == 1
    finally:
        del engine.forward_ends
        remove_offload(model)


def test_a_profiler_trace_of_an_offloaded_forward_names_the_fetches(tmp_path):
    model = offloaded("disk", tmp_path)
    try:
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.randn(2, WIDTH))
        names = [e.name for e in prof.events()]
        units = [u for u in _offloaded[model].units if u.records]
        assert names.count("swapio::fetch") == len(units)  # one per offloaded module's forward
        assert "swapio::read_wait" in names
    finally:
        remove_offload(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_profiler_trace_of_a_gpu_forward_names_the_copies(tmp_path):
    model = disk_offload(mlp(), tmp_path / "od", execution_device="cuda")
    try:
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.randn(2, WIDTH))
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        assert names.count("swapio::copy") >= 1 and "swapio::fetch" in names
        assert stats(model)["copies"] >= names.count("swapio::copy")
    finally:
        remove_offload(model)


# ---- progress -----------------------------------------------------------------------------------------------


def _data_file_bytes(directory):
    (name,) = [n for n in os.listdir(directory) if n.endswith(".bin")]
    return os.path.getsize(os.path.join(directory, name))


def test_disk_offload_draws_a_bar_of_the_weights_it_writes_when_asked(tmp_path, capsys, bars):
    pytest.importorskip("tqdm")
    model = disk_offload(mlp(), tmp_path / "od", progress=True)
    remove_offload(model)
    assert "swapio: writing offloaded weights" in capsys.readouterr().err
    (bar,) = bars
    assert bar.total == bar.n == _data_file_bytes(tmp_path / "od")


def test_disk_offload_draws_nothing_into_a_log_unless_asked(tmp_path, capsys, bars, monkeypatch):
    pytest.importorskip("tqdm")
    remove_offload(disk_offload(mlp(), tmp_path / "a"))  # capsys: stderr is not a terminal
    assert bars == [] and capsys.readouterr().err == ""
    monkeypatch.setenv(_progress.ENV, "1")
    remove_offload(disk_offload(mlp(), tmp_path / "b"))
    assert "swapio: writing offloaded weights" in capsys.readouterr().err
    remove_offload(disk_offload(mlp(), tmp_path / "c", progress=False))
    assert capsys.readouterr().err == ""
