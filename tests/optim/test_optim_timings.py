"""Where the optimizers' time goes: opt.step_report() says where a step's time went (kernel, I/O
waits, bytes moved), a torch.profiler trace shows swapio's phases by name, and save()/load() draw a progress
bar when asked, never into a log by default."""
import pytest
import torch

import swapio._progress as _progress
import swapio.core._ranges as _ranges
import swapio.optim as so
from helpers.optim import SMALL_BUFFERS

FIELDS = ("steps", "wall_s", "kernel_s", "io_wait_s", "other_s", "bytes_read", "bytes_written", "read_gbps",
          "write_gbps")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 64))


def optimizer(m, mode, tmp_path):
    return so.OffloadAdamW(m.parameters(), lr=1e-3, offload=mode, swap_dir=tmp_path, **SMALL_BUFFERS)


def train_step(m, opt):
    m(torch.randn(4, 128)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_step_report_accounts_each_step_and_sums_them(tmp_path, mode):
    m = model()
    with optimizer(m, mode, tmp_path) as opt:
        assert opt.step_report() == {"last": None, "total": None}
        state_bytes = None
        lasts = []
        for i in range(3):
            train_step(m, opt)
            last = opt.step_report()["last"]
            assert set(last) == set(FIELDS) and last["steps"] == 1
            assert all(last[k] >= 0 for k in FIELDS)
            assert last["kernel_s"] > 0  # the update ran inside the measured calls
            # kernel and waits are disjoint intervals inside the step, measured by one clock in one thread
            assert last["kernel_s"] + last["io_wait_s"] <= last["wall_s"]
            assert last["other_s"] == pytest.approx(last["wall_s"] - last["kernel_s"] - last["io_wait_s"])
            state_bytes = opt.memory_report()["state_bytes"]
            if mode == "cpu":
                assert last["bytes_read"] == last["bytes_written"] == 0
            else:  # every record written each step; read from the second step on (the first creates the state)
                assert last["bytes_written"] == state_bytes
                assert last["bytes_read"] == (0 if i == 0 else state_bytes)
                if i:
                    assert last["bytes_read"] + last["bytes_written"] == opt.memory_report()["io_bytes_per_step"]
                assert last["write_gbps"] == pytest.approx(last["bytes_written"] / last["wall_s"] / 1e9)
            lasts.append(last)
        total = opt.step_report()["total"]
        assert total["steps"] == 3
        for k in ("wall_s", "kernel_s", "io_wait_s", "other_s", "bytes_read", "bytes_written"):
            assert total[k] == pytest.approx(sum(last[k] for last in lasts))
        if mode == "nvme":
            assert total["bytes_written"] == 3 * state_bytes and total["bytes_read"] == 2 * state_bytes


def test_checkpoint_io_is_not_counted_as_a_step_and_reset_starts_afresh(tmp_path):
    m = model()
    with optimizer(m, "nvme", tmp_path) as opt:
        train_step(m, opt)
        report = opt.step_report()
        opt.save(tmp_path / "ckpt")
        opt.state_dict()  # reads the whole swap file through the same pipeline
        assert opt.step_report() == report
        assert opt.step_report(reset=True) == report
        assert opt.step_report() == {"last": None, "total": None}
        train_step(m, opt)
        assert opt.step_report()["total"]["steps"] == 1
        assert opt.step_report()["total"]["bytes_read"] == opt.memory_report()["state_bytes"]


def _swapio_ranges(prof):
    return {e.name for e in prof.events() if e.name.startswith("swapio::")}


def test_a_profiler_trace_of_an_nvme_step_names_its_phases(tmp_path):
    m = model()
    with optimizer(m, "nvme", tmp_path) as opt:
        train_step(m, opt)
        m(torch.randn(4, 128)).square().mean().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        assert {"swapio::step", "swapio::kernel", "swapio::read_wait", "swapio::write_wait"} <= _swapio_ranges(prof)
        count = lambda name: sum(e.name == name for e in prof.events())  # noqa: E731
        backend = opt._backend
        assert count("swapio::kernel") == sum(len(segs) for _, _, segs in backend.placed.values())  # per segment
        assert count("swapio::read_wait") == len(backend.chunks) > 1  # each chunk's record, read once
        assert count("swapio::step") == 1


def test_without_a_profiler_the_ranges_cost_nothing():
    assert _ranges.section("swapio::step") is _ranges._OFF  # no RecordFunction is built on the hot path
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _ranges.section("swapio::step") is not _ranges._OFF


# ---- progress -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_save_and_load_draw_a_bar_of_the_state_bytes_when_asked(tmp_path, capsys, bars, mode):
    pytest.importorskip("tqdm")
    m = model()
    with optimizer(m, mode, tmp_path) as opt:
        train_step(m, opt)
        payload = sum(p.numel() * 4 * 2 for p in m.parameters())  # fp32 exp_avg and exp_avg_sq
        opt.save(tmp_path / "ckpt", progress=True)
        err = capsys.readouterr().err
        assert "swapio: saving optimizer" in err
        (saved,) = bars
        assert saved.total == payload and saved.n == payload
        opt.load(tmp_path / "ckpt", progress=True)
        assert "swapio: loading optimizer" in capsys.readouterr().err
        loaded = bars[1]
        assert loaded.total == payload and loaded.n == payload


def test_save_and_load_draw_nothing_into_a_log_unless_the_environment_asks(tmp_path, capsys, bars, monkeypatch):
    pytest.importorskip("tqdm")
    m = model()
    with optimizer(m, "cpu", tmp_path) as opt:
        train_step(m, opt)
        opt.save(tmp_path / "ckpt")  # capsys: stderr is not a terminal
        opt.load(tmp_path / "ckpt")
        assert bars == [] and capsys.readouterr().err == ""
        monkeypatch.setenv(_progress.ENV, "1")
        opt.save(tmp_path / "ckpt")
        assert "swapio: saving optimizer" in capsys.readouterr().err
        opt.save(tmp_path / "ckpt", progress=False)  # the argument beats the environment
        assert capsys.readouterr().err == ""
