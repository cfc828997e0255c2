"""OffloadAdafactor's host memory, measured in a child process as peak RSS growth over its steps: for a 4096 x 4096
weight the state is the fp32 master where OffloadAdamW keeps one (bf16) or nothing (fp32, its own master) plus the
factored moments and the kernel's passing sums; AdamW's two fp32 moments (128 MiB) for scale. Also nvme mode's
pinned slots, which hold whole parameters."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401
from helpers.rss_child import PRELUDE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
SLACK = 8 * MiB  # the kernel's column partial sums (1 MiB here), row sums, allocator rounding

CHILD = PRELUDE + textwrap.dedent("""
    import json, sys
    import torch
    import swapio.optim as so

    cls, dtype, offload, swap_dir = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], sys.argv[4]
    w = torch.zeros(4096, 4096, dtype=dtype, requires_grad=True)
    w.grad = torch.full_like(w, 1e-3)
    tiny = torch.zeros(8, requires_grad=True)  # one-time costs that are not optimizer state (imports, pools)
    tiny.grad = torch.ones(8)
    with getattr(so, cls)([tiny], offload=offload, swap_dir=swap_dir) as warm:
        warm.step()
    baseline = status("VmRSS")
    reset = reset_peak()
    opt = getattr(so, cls)([w], offload=offload, swap_dir=swap_dir)
    for _ in range(2):
        opt.step()
    peak = status("VmHWM")
    report = opt.memory_report()
    opt.close()
    print(json.dumps({"growth": peak - baseline, "reset": reset, "bytes_per_param": report["bytes_per_param"]}))
""")


def _child(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,master", [("float32", 0), ("bfloat16", 64 * MiB)])
def test_peak_rss_of_a_4096_square_weight_is_its_master_and_next_to_nothing(dtype, master, tmp_path):
    out = _child("OffloadAdafactor", dtype, "cpu", tmp_path)
    if not out["reset"]:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    print(f"peak RSS growth {out['growth'] / MiB:.1f} MiB (master {master / MiB:.0f} MiB)")
    assert out["growth"] <= master + SLACK
    adamw = _child("OffloadAdamW", dtype, "cpu", tmp_path)
    assert adamw["growth"] >= master + 128 * MiB  # its two fp32 moments: the measurement sees state


def test_nvme_slots_hold_whole_parameters_and_small_ones_share_a_record(tmp_path):
    """SMALL_BUFFERS' slots are 64 KiB: a 300 x 70 bf16 weight's master (82 KiB) is never split, so the slots
    grow to its record; parameters that fit share records as the other optimizers' do."""
    big = torch.zeros(300, 70, dtype=torch.bfloat16, requires_grad=True)
    small = [torch.zeros(10, 20, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    opt = so.OffloadAdafactor([big, *small], offload="nvme", swap_dir=tmp_path, **SMALL_BUFFERS)
    for p in (big, *small):
        p.grad = torch.ones_like(p)
    opt.step()
    backend = opt._backend
    assert len(backend.placed[big][2]) == 1  # one segment: the whole parameter
    assert len({id(backend.placed[p][2][0][0]) for p in small}) == 1  # one record for the three small ones
    report = opt.memory_report()
    largest = max(c.record_bytes for c in backend.chunks)
    assert largest > SMALL_BUFFERS["buffer_bytes"] // SMALL_BUFFERS["buffer_count"]
    assert report["pinned_parts"]["state"]["budget"] == SMALL_BUFFERS["buffer_count"] * largest
    opt.close()


@pytest.mark.parametrize("shape", [(32, 128, 1, 1), (1, 4096), (4096, 1)])
def test_nvme_records_stay_within_a_slot_when_the_factors_are_as_large_as_the_parameter(shape, tmp_path):
    """A 1 x 1 convolution's factors hold two numbers per weight (torch's state too), a 1 x n head's one: a
    chunk packed by element count alone (as if factors were next to nothing) held 4 such fp32 weights in a record
    of twice the 64 KiB slot, and the slots grew past buffer_bytes with no parameter needing it. Each record now
    fits the slot; the steps still match torch.optim.Adafactor."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).requires_grad_(True) for _ in range(16)]
    refs = [p.detach().clone().requires_grad_(True) for p in params]
    opt = so.OffloadAdafactor(params, offload="nvme", swap_dir=tmp_path, **SMALL_BUFFERS)
    ref = torch.optim.Adafactor(refs)
    for _ in range(2):
        for p, r in zip(params, refs):
            p.grad = torch.randn(shape, generator=gen)
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    slot = SMALL_BUFFERS["buffer_bytes"] // SMALL_BUFFERS["buffer_count"]
    assert max(c.record_bytes for c in opt._backend.chunks) <= slot
    assert opt.memory_report()["pinned_bytes"] <= SMALL_BUFFERS["buffer_bytes"]
    for p, r in zip(params, refs):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
    opt.close()
