"""swapio demo: a tiny run trains three identical models, the offloaded ones like torch's AdamW, reports every
logged step, and leaves no swap file behind."""
import json
import os
import subprocess
import sys

import pytest
import torch

from swapio.tools import demo, demo_model

TINY = dict(steps=4, layers=1, width=32, heads=2, context=16, batch=4, log_every=2, progress=False,
            buffer_bytes=4 << 16)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo")
    r = demo.run_demo(demo.DemoConfig(directory=str(directory), **TINY))
    assert os.listdir(directory) == []  # the temporary swap directory is gone
    return r


def test_offloaded_runs_follow_torch_adamw(result):
    ref = result.losses["torch AdamW"]
    assert len(ref) == 4 and ref[-1] < ref[0]
    assert result.losses['offload="cpu"'] == result.losses['offload="nvme"']  # same kernel, state in RAM or on disk
    for loss, expected in zip(result.losses['offload="cpu"'], ref):
        assert loss == pytest.approx(expected, rel=1e-5)


def test_report_has_every_logged_step_and_the_measurements(result):
    text = demo.report(result)
    step_rows = [line.split()[0] for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert step_rows == ["1", "2", "4"]
    for label in ("optimizer step (median)", "host RAM held by state", "state on disk", "max |diff| vs torch"):
        assert label in text
    assert set(result.state_ram) == set(demo.RUNS)
    assert result.state_disk >= 8 * result.params  # two fp32 moments per parameter, on disk


def test_plot_writes_a_png(result, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    demo.plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corpus_is_text_from_the_standard_library():
    data = demo_model.corpus_bytes()
    assert data.numel() > 100_000 and data.dtype == torch.long
    assert b"ArgumentParser" in bytes(data[:200_000].to(torch.uint8).tolist())


FRESH_PROCESS_DEMO = """
import json, sys
from swapio.tools import demo
r = demo.run_demo(demo.DemoConfig(directory=sys.argv[1], steps=1, layers=1, width=64, heads=2, context=16, batch=2,
                                  progress=False, buffer_bytes=1 << 20))
print(json.dumps({"state_ram": r.state_ram, "moments": r.state_bytes}))
"""


@pytest.mark.slow  # a fresh process: what the first optimizer pays only once shows there, not in this one
def test_host_ram_held_by_state_is_each_optimizers_own(tmp_path):
    """The report's "host RAM held by state" against what each optimizer keeps: torch's and cpu mode's fp32 moments,
    nvme mode's pinned pipeline, min(--buffer, state). The process's one-time setup of the I/O engine and the fused
    kernel was counted in the first step that used them (0.6 MiB for 0.2 MiB of moments in nvme mode, above the
    --buffer bound the report states)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS_DEMO, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    moments, ram = doc["moments"], doc["state_ram"]
    slack = 96 << 10  # page rounding, heap reuse and the step's bookkeeping
    assert abs(ram["torch AdamW"] - moments) <= slack, ram
    assert abs(ram['offload="cpu"'] - moments) <= slack, ram
    assert ram['offload="nvme"'] <= min(1 << 20, moments) + slack, ram
    assert os.listdir(tmp_path) == []


KILLED_MID_RUN = """
import os, sys
from swapio.tools import demo

real_trim = demo._trim_heap
steps = []


def trim_then_die():  # called once per run at step 1: the third time, the nvme run's swap file is written
    real_trim()
    steps.append(1)
    if len(steps) == 3:
        os.kill(os.getpid(), 9)


demo._trim_heap = trim_then_die
demo.run_demo(demo.DemoConfig(directory=sys.argv[1], steps=4, layers=1, width=32, heads=2, context=16, batch=2,
                              progress=False, buffer_bytes=1 << 20))
"""


def test_a_run_killed_mid_way_is_cleaned_up_by_the_next_one(tmp_path):
    """SIGKILL (the OOM killer, a job's time limit) runs no cleanup: the swap directory stays. It is claimed as the
    optimizers claim theirs, so the next run on the same --dir removes it (before, each run made its own and a
    killed one's stayed for good)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_RUN, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert os.listdir(tmp_path), "the killed run left nothing to clean up: the test did not kill it mid-run"
    with pytest.warns(Warning, match="(?i)died|dead|left"):
        demo.run_demo(demo.DemoConfig(directory=str(tmp_path), **TINY))
    assert os.listdir(tmp_path) == []
