"""Bounds: host memory while training an offloaded model with >= 1 GiB of weights stays within the
weight ring (buffer_bytes) + the optimizer's buffer budget + a small multiple of the largest offloaded module +
activations. Measured in a child process: VmHWM (peak RSS) reset after the model is set up (clear_refs 5), then
one training step with disk_offload(checkpoint=..., offload_dir=...) + OffloadAdamW(offload="nvme",
in_backward=True, state_dtype="bf16")."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers.rss_child import reset_peak, status

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
MiB = 1 << 20
LAYERS, DIM = 8, 8192  # 8 x 8192 x 8192 bf16 = 1 GiB of weights, each module 128 MiB
RING = 256 * MiB       # disk_offload's buffer_bytes: two modules
OPT_BUDGET = 64 * MiB  # the optimizer's buffer_bytes


def write_checkpoint(path, layers=LAYERS):
    """A safetensors file of LAYERS bf16 DIM x DIM weights, written a layer at a time (never 1 GiB in RAM)."""
    size = DIM * DIM * 2
    header = {f"{i}.weight": {"dtype": "BF16", "shape": [DIM, DIM], "data_offsets": [i * size, (i + 1) * size]}
              for i in range(layers)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(DIM, DIM, generator=g) * DIM ** -0.5).to(torch.bfloat16)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i in range(layers):
            f.write((base * (1 + i / 16)).view(torch.uint8).numpy().tobytes())


def child(ckpt, od, swap, layers=LAYERS):
    """Runs in a new process: prints a JSON line with the RSS figures."""
    torch.set_num_threads(1)
    from swapio.offload import disk_offload
    from swapio.optim import OffloadAdamW

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    model = disk_offload(model, checkpoint=ckpt, offload_dir=od, buffer_bytes=RING)
    opt = OffloadAdamW(model.parameters(), lr=1e-4, offload="nvme", swap_dir=swap, state_dtype="bf16",
                       in_backward=True, buffer_bytes=OPT_BUDGET)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert reset_peak()  # VmHWM := VmRSS
    base = status("VmRSS")
    t0 = time.perf_counter()
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    elapsed = time.perf_counter() - t0
    peak = status("VmHWM")
    report = opt.memory_report()
    print(json.dumps({"base": base, "peak": peak, "growth": peak - base, "step_s": elapsed,
                      "params": report["params"], "grad_bytes": report["grad_bytes"]}))


def measure(tmp_path, layers):
    ckpt = str(tmp_path / f"model{layers}.safetensors")
    write_checkpoint(ckpt, layers)
    swap, od = tmp_path / f"swap{layers}", tmp_path / f"od{layers}"
    os.makedirs(swap)
    code = (f"import sys; sys.path[:0] = [{HERE!r}, {TESTS!r}]; import test_offload_train_memory as m; "
            f"m.child({ckpt!r}, {str(od)!r}, {str(swap)!r}, {layers})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["params"] == layers * DIM * DIM
    assert got["grad_bytes"] == 0  # in backward: no gradient stored
    for path in (ckpt, od, swap):  # the disk: 1 GiB each for the checkpoint and offload_dir, 4 GiB of state
        subprocess.run(["rm", "-rf", str(path)], check=True)
    return got


@pytest.mark.slow
def test_training_peak_rss_is_bounded_for_a_1gib_model(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    assert LAYERS * DIM * DIM * 2 >= 1 << 30
    big = measure(tmp_path, LAYERS)
    small = measure(tmp_path, LAYERS // 2)
    print(big, small)
    largest = DIM * DIM * 2
    # the ring + the optimizer's budget + a small multiple of the largest module + activations (KiBs). The
    # multiple, from the design (swapio/optim/offloaded.py): autograd's bf16 gradient (1x), its fp32 copy (2x),
    # MAX_QUEUED=2 records' fp32 gradients waiting for the worker (4x), the record buffer it rewrites (1x): 8x.
    # Measured here: about 1.1-1.2 GiB of growth for 8 layers and for 4 (~0.85 GiB during backward above the
    # ring): more than this 1 GiB model's weights, but a constant, not a share of the model.
    bound = RING + OPT_BUDGET + 8 * largest + 64 * MiB
    for got in (big, small):
        assert got["growth"] <= bound, f"peak RSS grew {got['growth'] / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
    # whatever the model size: 4 layers and 8 stay under the same bound (the difference between the two runs
    # is timing noise here, +-250 MiB either way, from how far backward runs ahead of the in-backward worker,
    # so it is not asserted)
