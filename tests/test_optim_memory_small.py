"""offload="nvme" costs a small model no more host memory than offload="cpu" plus 64 MiB: its pinned buffers are
sized to the state (never larger than the state needs), not to buffer_bytes. Each mode runs in a child process
that reports the growth of its peak RSS over two AdamW steps of 3 M fp32 parameters (24 MB of state)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from rss_child import PRELUDE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
SHAPES = [(1000, 1000), (1000, 1000), (1_000_000,)]  # 3 M parameters
BOUND = 64 * MiB

CHILD = PRELUDE + textwrap.dedent("""
    import json, sys
    import torch
    import swapio.optim as so

    mode, swap_dir, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    extra = {"swap_dir": swap_dir} if mode == "nvme" else {}
    torch.manual_seed(0)
    params = [torch.randn(s).requires_grad_(True) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    tiny = torch.zeros(8, requires_grad=True)  # one-time costs that are not optimizer state (lazy imports)
    tiny.grad = torch.ones(8)
    with so.OffloadAdamW([tiny], offload=mode, **extra) as warm:
        warm.step()
        warm.state_dict()
    del warm
    baseline = status("VmRSS")
    reset = reset_peak()
    opt = so.OffloadAdamW(params, lr=1e-3, offload=mode, **extra)
    for _ in range(2):
        opt.step()
    peak = status("VmHWM")
    report = opt.memory_report()
    opt.close()
    print(json.dumps({"growth": peak - baseline, "reset": reset, "report": report}))
""")


def _growth(mode, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(tmp_path), json.dumps(SHAPES)], capture_output=True,
                       text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_nvme_costs_a_small_model_at_most_64_mib_more_than_cpu(tmp_path):
    cpu, nvme = _growth("cpu", tmp_path), _growth("nvme", tmp_path)
    if not (cpu["reset"] and nvme["reset"]):
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    state = cpu["report"]["state_bytes"]
    assert state == 24_000_000  # exp_avg and exp_avg_sq; the fp32 parameters are their own masters
    assert nvme["report"]["pinned_bytes"] <= state + 3 * 4096 * 4  # the buffers: no more than the state needs
    print(f"peak RSS growth: cpu {cpu['growth'] / MiB:.1f} MiB, nvme {nvme['growth'] / MiB:.1f} MiB "
          f"(pinned {nvme['report']['pinned_bytes'] / MiB:.1f} MiB)")
    assert nvme["growth"] - cpu["growth"] <= BOUND
