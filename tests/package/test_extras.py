"""The library needs torch and xxhash only; numpy and tqdm come with the `cli` extra, which the `swapio` command
checks for and names. Run in a child where numpy and tqdm cannot be imported, as on a machine without them."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # each test starts Python twice

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCK = """
import sys
sys.modules["numpy"] = sys.modules["tqdm"] = None  # as if not installed: import fails, find_spec is None
"""


def run_without_extras(code, tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "SWAPIO_PROGRESS": "1"}
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)


def test_the_library_works_without_numpy_and_tqdm(tmp_path):
    r = run_without_extras("""
        import torch, swapio, swapio.optim, swapio.offload, swapio.checkpoint
        from swapio import _progress
        assert sys.modules["numpy"] is None and sys.modules["tqdm"] is None
        assert _progress.bar(total=3) is None          # asked for, but no tqdm: no bar, no error
        p = torch.nn.Parameter(torch.randn(1000))
        opt = swapio.optim.OffloadAdamW([p], lr=1e-2)
        p.grad = torch.randn(1000)
        opt.step()
        with swapio.AioHandle() as h:
            h.pwrite(p.detach(), "t.bin").wait()
            back = torch.empty(1000)
            h.pread(back, "t.bin").wait()
        assert torch.equal(back, p.detach())
        swapio.checkpoint.save({"p": p.detach(), "step": 1}, "c.safetensors")
        assert torch.equal(swapio.checkpoint.load("c.safetensors")["p"], p.detach())
        assert sys.modules["numpy"] is None and sys.modules["tqdm"] is None
        print("ok")
    """, tmp_path)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_the_command_names_the_missing_extra(tmp_path):
    r = run_without_extras("""
        from swapio.tools.entry import main
        sys.exit(main(["info"]))
    """, tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "pip install 'swapio[cli]'" in r.stderr and "numpy, tqdm" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_command_runs_with_its_extras():
    from swapio.tools.entry import main, missing_extras
    assert missing_extras() == []
    assert main(["plan", "--params", "1B", "--ram", "16G"]) == 0
