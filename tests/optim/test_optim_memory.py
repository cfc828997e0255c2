"""offload="nvme" keeps host memory bounded by its buffers: a child process with 1.5 GiB of optimizer state
(128 Mi bf16 parameters: fp32 master + two fp32 moments) must not grow its peak RSS by more than
buffer_bytes + 256 MiB over the baseline taken after its parameters and gradients exist; its checkpoint's save
and load stream through those buffers too."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from helpers.rss_child import PRELUDE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
NUMEL = 128 * MiB          # parameters, bf16: 256 MiB of params + 256 MiB of grads in RAM
BUFFER_BYTES = 64 * MiB    # the optimizer's pinned buffer budget
SLACK = 256 * MiB

CHILD = PRELUDE + textwrap.dedent("""
    import json, os, sys, time
    import torch
    import swapio.optim as so

    numel, buffer_bytes, swap_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    params = [torch.empty(numel // 4, dtype=torch.bfloat16).normal_().requires_grad_(True) for _ in range(4)]
    for p in params:
        p.grad = torch.empty_like(p).normal_()
    # one-time costs that are not optimizer state (torch.optim imports torch._dynamo on first use: ~70 MiB)
    tiny = torch.zeros(8, requires_grad=True)
    tiny.grad = torch.ones(8)
    with so.OffloadAdamW([tiny], offload="nvme", swap_dir=swap_dir, buffer_bytes=1 << 20) as warm:
        warm.step()
        warm.state_dict()
    del warm
    baseline = status("VmRSS")
    reset = reset_peak()
    t0 = time.perf_counter()
    opt = so.OffloadAdamW(params, lr=1e-3, offload="nvme", swap_dir=swap_dir, buffer_bytes=buffer_bytes,
                          buffer_count=4)
    for _ in range(2):
        opt.step()
    state_bytes = os.path.getsize(os.path.join(opt.swap_path, "state.swap"))
    elapsed = time.perf_counter() - t0
    peak = status("VmHWM")
    steps = [s["step"].item() for s in opt.state.values()]
    opt.close()
    print(json.dumps({"baseline": baseline, "peak": peak, "reset": reset, "state_bytes": state_bytes,
                      "elapsed": elapsed, "steps": steps}))
""")


def _child(script, *args):
    """The JSON a child process running `script` with args prints last."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_nvme_state_of_1_5_gib_keeps_rss_within_buffer_budget(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    if free < 3 * 1024 * MiB:
        pytest.skip(f"needs 3 GiB free on {tmp_path}, has {free / 2**30:.1f} GiB")
    out = _child(CHILD, NUMEL, BUFFER_BYTES, tmp_path)
    assert out["state_bytes"] >= 1.5 * 1024 * MiB
    assert out["steps"] == [2.0] * 4
    growth = out["peak"] - out["baseline"]
    print(f"peak RSS growth {growth / MiB:.0f} MiB (budget {BUFFER_BYTES / MiB:.0f} + {SLACK / MiB:.0f} MiB), "
          f"2 steps in {out['elapsed']:.1f} s, baseline {out['baseline'] / MiB:.0f} MiB")
    if not out["reset"]:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    assert growth < BUFFER_BYTES + SLACK


SAVE_CHILD = PRELUDE + textwrap.dedent("""
    import json, os, sys
    import torch
    import swapio.optim as so

    numel, buffer_bytes, swap_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    params = [torch.randn(numel // 2).requires_grad_(True) for _ in range(2)]
    opt = so.OffloadAdamW(params, lr=1e-3, offload="nvme", swap_dir=swap_dir, buffer_bytes=buffer_bytes)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    for p in params:
        p.grad = None
    opt.save(os.path.join(swap_dir, "warm"))  # one-time costs (imports, the header's staging)
    out = {}
    for what in ("save", "load"):
        baseline, reset = status("VmRSS"), reset_peak()
        opt.save(os.path.join(swap_dir, "ckpt")) if what == "save" else opt.load(os.path.join(swap_dir, "ckpt"))
        out[what] = status("VmHWM") - baseline
    out["reset"] = reset
    out["file"] = os.path.getsize(os.path.join(swap_dir, "ckpt", "swapio-optim.safetensors"))
    opt.close()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_nvme_save_and_load_of_a_state_larger_than_the_buffers_keep_rss_bounded(tmp_path):
    """opt.save streams the swap file into the checkpoint chunk by chunk (never a copy of the state in RAM), and
    load streams it back: 256 MiB of state through 16 MiB of buffers grows the peak RSS by far less."""
    numel, buffers = 32 * MiB, 16 * MiB  # fp32 parameters: two fp32 moments, 256 MiB
    out = _child(SAVE_CHILD, numel, buffers, tmp_path)
    assert out["file"] >= 2 * 4 * numel
    print(f"peak RSS growth: save {out['save'] / MiB:.0f} MiB, load {out['load'] / MiB:.0f} MiB "
          f"(state {out['file'] / MiB:.0f} MiB, buffers {buffers / MiB:.0f} MiB)")
    if not out["reset"]:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    assert out["save"] < buffers + 64 * MiB
    assert out["load"] < buffers + 64 * MiB
