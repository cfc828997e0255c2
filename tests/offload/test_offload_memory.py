"""disk_offload keeps host memory for weights within buffer_bytes + the largest submodule: a child process runs
a forward over 1.125 GiB of weights read from a safetensors checkpoint (model built on meta) with
buffer_bytes = 128 MiB, and its peak RSS, from before disk_offload to after the forward, may grow by at most
buffer_bytes + largest submodule + 256 MiB."""
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from helpers.rss_child import PRELUDE
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
WIDTH, LAYERS = 4096, 18                  # 18 x 64 MiB fp32 = 1.125 GiB of weights
LAYER_BYTES = WIDTH * WIDTH * 4
BUFFER_BYTES = 128 * MiB
SLACK = 256 * MiB

CHILD = PRELUDE + textwrap.dedent("""
    import json, sys, time
    import torch
    from swapio.offload import disk_offload, stats

    path, width, layers, buffer_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    x = torch.ones(1, width)
    with torch.no_grad():  # one-time costs that are not weights: the matmul kernel's first call
        torch.nn.functional.linear(x, torch.zeros(8, width))
    baseline = status("VmRSS")  # before disk_offload: its ring counts
    reset = reset_peak()
    t0 = time.perf_counter()
    disk_offload(model, checkpoint=path, buffer_bytes=buffer_bytes)
    with torch.no_grad():
        y = model(x)
    elapsed = time.perf_counter() - t0
    peak = status("VmHWM")
    print(json.dumps({"baseline": baseline, "peak": peak, "reset": reset, "elapsed": elapsed,
                      "ones": bool(torch.allclose(y, torch.ones_like(y))), "stats": stats(model)}))
""")


def write_checkpoint(path):
    """A safetensors file written tensor by tensor (the format: u64 header length, JSON header, data), so the
    test itself never holds the weights: every weight is 1/width, so the output of ones is ones."""
    header, offset = {}, 0
    for i in range(LAYERS):
        header[f"{i}.weight"] = {"dtype": "F32", "shape": [WIDTH, WIDTH], "data_offsets": [offset, offset + LAYER_BYTES]}
        offset += LAYER_BYTES
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    layer = torch.full((WIDTH, WIDTH), 1.0 / WIDTH).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _ in range(LAYERS):
            f.write(layer)


@pytest.mark.slow
def test_forward_over_1_gib_keeps_rss_within_ring_plus_largest_submodule(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    if free < 3 * 1024 * MiB:
        pytest.skip(f"needs 3 GiB free on {tmp_path}, has {free / 2**30:.1f} GiB")
    path = tmp_path / "big.safetensors"
    write_checkpoint(path)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(WIDTH), str(LAYERS), str(BUFFER_BYTES)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ones"]
    assert out["stats"]["bytes_read"] >= LAYERS * LAYER_BYTES and out["stats"]["temp"] == 0
    growth = out["peak"] - out["baseline"]
    bound = BUFFER_BYTES + LAYER_BYTES + SLACK
    print(f"peak RSS growth {growth / MiB:.0f} MiB over a forward of {LAYERS * LAYER_BYTES / MiB:.0f} MiB of "
          f"weights in {out['elapsed']:.1f} s (bound {bound / MiB:.0f} MiB)")
    if not out["reset"]:
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    assert growth <= bound
