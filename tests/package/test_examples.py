"""The scripts in examples/ run as a user runs them (a fresh Python process, in another directory) and finish
with "ok"; each checks its own result (bit-identical resume, equal logits, equal bytes) and raises otherwise."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = ["swap_tensors.py", "weight_offload_llama.py", "optimizer_offload_trainer.py"]


def test_every_example_is_tested():
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py")) == sorted(EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs(script, tmp_path):
    if script != "swap_tensors.py":
        pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "ok", proc.stdout[-2000:]
    assert os.listdir(tmp_path) == []  # each example cleans up after itself


@pytest.mark.slow
def test_an_example_given_a_new_dir_makes_it(tmp_path):
    """`--dir DIR` ("where the swap files go"): a directory that does not exist yet is made, as swapio's own
    swap_dir is (it was a FileNotFoundError traceback); the run's files are gone afterwards."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    new = tmp_path / "new" / "swap"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "swap_tensors.py"), "--dir", str(new)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "ok" and os.listdir(new) == []
