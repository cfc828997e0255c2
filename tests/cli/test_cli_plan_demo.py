"""`swapio plan` and `swapio demo` on the command line; `swapio tune --dir D` writes its config into D; one exit
status (2, bad usage) for a missing path whichever command is given it."""
import json
import os

import pytest

from swapio.tools import plan
from helpers.cli import assert_one_line_error, run_cli

GB = 10**9


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_plan_json_70b_fp16_adam(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--params", "70B", "--dtype", "fp16", "--optimizer", "adam",
                         "--gpu-mem", "80G", "--ram", "1T", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["totals"]["weights"] == 140 * GB and doc["bytes_per_param"]["optimizer_state"] == 12
    assert doc["capacity"] == {"gpu": 80 << 30, "ram": 1 << 40, "disk_free": None}
    assert doc["nvme_step_seconds"] is None


def test_plan_text_names_the_totals_and_verdicts(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--params", "7B", "--gpu-mem", "80G", "--ram", "64G")
    assert rc == 0
    # binary out as in: 7e9 x 2 bytes = 13.0 GiB; --ram 64G is 64 GiB, printed as such (it was "68.7 GB")
    assert "weights 13.0 GiB, gradients 13.0 GiB, optimizer state 78.2 GiB, all 104.3 GiB" in out
    assert "(GPU 80.0 GiB, RAM 64.0 GiB)" in out and " GB" not in out
    rows = {line.split(" (")[0]: line for line in out.splitlines()
            if line.startswith(("no offload", "offload=", "no GPU"))}
    assert rows["no offload"].endswith("no: GPU too small")
    assert rows['offload="cpu"'].endswith("no: RAM too small")
    assert rows['offload="nvme"'].endswith("? (disk not given)")
    # training on the CPU has its rows too: everything in RAM (104.3 GiB), or the state on disk
    assert "104.3 GiB" in rows['no GPU, offload="cpu"'] and rows['no GPU, offload="cpu"'].endswith("no: RAM too small")
    assert rows['no GPU, offload="nvme"'].endswith("? (disk not given)")
    assert "Weights + gradients alone" not in out  # 26 GiB fit the 80 GiB GPU: no advice about that


@pytest.mark.parametrize("argv, needle", [
    (["--ram", "64"], "'64' has no unit"),           # was taken as 64 bytes ("RAM 0.0 MiB")
    (["--gpu-mem", "80"], "'80' has no unit"),
    (["--ram", "0"], "must be positive"),            # was accepted
    (["--ram", "0G"], "must be positive"),
    (["--gpu-mem", "0M"], "must be positive"),
    (["--buffer-bytes", "0"], "must be positive"),
])
def test_plan_rejects_memory_sizes_without_unit_or_zero(capsys, argv, needle):
    rc, _, err = run_cli(capsys, "plan", "--params", "7B", *argv)
    assert_one_line_error(rc, err, needle)
    assert rc == 2


def test_plan_advice_when_weights_exceed_the_gpu_says_what_trains_today(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--params", "7B", "--gpu-mem", "24G", "--ram", "64G")
    assert rc == 0
    advice = out.split("Weights + gradients alone (26.1 GiB) exceed the GPU (24.0 GiB)")[1]
    assert "LoRA" in advice and "Offload the weights too" in advice
    assert "offload the weights too" not in out  # the old advice: it cannot train them


def test_plan_step_time_from_the_tune_config_in_the_disk_directory(capsys, tmp_path):
    disk = tmp_path / "nvme"
    disk.mkdir()
    (disk / "swapio-io.json").write_text(json.dumps(
        {"handle": {}, "measured": {"directory": str(disk), "both": {"read_gb_s": 2.0, "write_gb_s": 1.0}}}))
    rc, out, _ = run_cli(capsys, "plan", "--params", "1B", "--disk", str(disk), "--json")
    assert rc == 0
    doc = json.loads(out)
    # 1e9 bf16 params: 12 GB of state, read at 2 GB/s (6 s) and written at 1 GB/s (12 s)
    assert doc["nvme_step_seconds"] == pytest.approx(18.0)
    assert doc["disk"]["bandwidth_from"] == str(disk / "swapio-io.json")


def test_plan_measures_the_disk_without_a_config(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "MEASURE_SIZE", 8 << 20)
    rc, out, _ = run_cli(capsys, "plan", "--params", "1B", "--disk", str(tmp_path), "--json")
    assert rc == 0
    doc = json.loads(out)
    read, write = doc["disk"]["read_bytes_per_s"], doc["disk"]["write_bytes_per_s"]
    assert read > 0 and write > 0 and doc["disk"]["bandwidth_from"].startswith("measured now")
    assert doc["nvme_step_seconds"] == pytest.approx(12 * GB / read + 12 * GB / write)
    assert os.listdir(tmp_path) == []  # the measurement's file is gone


def test_plan_rejects_bad_counts(capsys):
    rc, _, err = run_cli(capsys, "plan", "--params", "7X")
    assert rc == 2
    assert_one_line_error(rc, err, "parameter count")


MISSING = [("info", "--path"), ("bench", "--dir"), ("tune", "--dir"), ("plan", "--disk"), ("demo", "--dir")]


@pytest.mark.parametrize("command, flag", MISSING, ids=[c for c, _ in MISSING])
def test_missing_path_exits_2_for_every_command(capsys, command, flag):
    extra = ["--params", "1B"] if command == "plan" else []
    rc, _, err = run_cli(capsys, command, flag, "/nonexistent/swapio", *extra)
    assert_one_line_error(rc, err, "/nonexistent/swapio does not exist")
    assert rc == 2


def test_tune_writes_its_config_into_dir_and_says_where(capsys, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    rc, out, _ = run_cli(capsys, "tune", "--dir", str(disk), "--size", "2M", "--bs", "1M", "--iodepth", "1",
                         "--threads", "1", "--engines", "psync", "--point-time", "0.02", "--warmup", "0", "-q")
    assert rc == 0
    assert os.listdir(tmp_path) == ["disk"] and (disk / "swapio-io.json").is_file()
    assert f"wrote {disk / 'swapio-io.json'}" in out


def test_demo_tiny_run_with_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, out, err = run_cli(capsys, "demo", "--steps", "2", "--layers", "1", "--width", "16", "--heads", "2",
                           "--context", "8", "--batch", "2", "--log-every", "1", "--buffer", "256K", "--plot",
                           "loss.png", "-q")
    assert rc == 0, err
    assert "host RAM held by state" in out and f"wrote {tmp_path / 'loss.png'}" in out
    assert sorted(os.listdir(tmp_path)) == ["loss.png"]  # no swap directory left behind


def test_demo_rejects_bad_sizes(capsys):
    rc, _, err = run_cli(capsys, "demo", "--width", "30", "--heads", "4")
    assert rc == 2
    assert_one_line_error(rc, err, "multiple of --heads")


@pytest.mark.parametrize("lr", ["0", "-1", "nan", "inf"])
def test_demo_rejects_a_learning_rate_that_is_not_positive_and_finite(capsys, lr):
    # inf passed the check and reached torch's AdamW: "Invalid learning rate: inf", exit 1 as if the run had failed
    rc, _, err = run_cli(capsys, "demo", "--lr", lr, "--steps", "1", "--layers", "1", "--width", "16", "--heads", "2",
                         "--context", "8", "--batch", "1")
    assert_one_line_error(rc, err, "--lr must be positive and finite")
    assert rc == 2


def test_demo_rejects_a_context_longer_than_its_corpus(capsys):
    # It used to build the model first and fail allocating it: an "internal error", exit 1.
    rc, _, err = run_cli(capsys, "demo", "--context", "100000000", "--steps", "1")
    assert_one_line_error(rc, err, "--context must be below")
    assert rc == 2


def test_plan_activations_row_from_seq_batch_and_shape(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--params", "350M", "--ram", "64G", "--seq", "2048", "--batch", "4",
                         "--hidden", "1024", "--layers", "24", "--json")
    assert rc == 0
    a = json.loads(out)["activations"]
    assert a["per_layer"] == 2048 * 4 * 1024 * 34 and a["total"] == 24 * a["per_layer"]
    rc, out, _ = run_cli(capsys, "plan", "--params", "350M", "--ram", "64G", "--seq", "2048", "--batch", "4",
                         "--hidden", "1024", "--layers", "24")
    assert rc == 0
    rows = [line for line in out.splitlines() if line.strip().startswith(("no activation", "offload_activations"))]
    assert len(rows) == 3 and rows[0].split()[3:5] == ["6.4", "GiB"]  # 24 x 272 MiB on the device
    assert "activations (give --seq" not in out
    rc, out, _ = run_cli(capsys, "plan", "--params", "350M", "--ram", "64G")
    assert "give --seq, --batch, --hidden and --layers" in out and "activations:" not in out


@pytest.mark.parametrize("argv, needle", [(["--seq", "2048"], "--batch, --hidden, --layers missing"),
                                          (["--seq", "0", "--batch", "1", "--hidden", "8", "--layers", "1"],
                                           "--seq must be positive")])
def test_plan_activations_need_the_whole_shape(capsys, argv, needle):
    rc, _, err = run_cli(capsys, "plan", "--params", "350M", *argv)
    assert rc == 2 and needle in err
