"""accelerate's CPU multi-process training (2 processes, gloo, launched by accelerate's debug_launcher) with
OffloadAdamW: prepare wraps the model in DDP, accumulate() skips the gradient all-reduce (no_sync) and the step
until sync_gradients, clip_grad_norm_ clips the averaged gradients. The weights equal those of the same script
with torch's fused AdamW, bit for bit. (An offloaded model cannot be wrapped in DDP: docs/offload.md.)"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUSED_BITS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _train(kind, out_file, swap_dir):
    import swapio.optim as so
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = so.OffloadAdamW(model.parameters(), lr=1e-2, offload=kind,
                              swap_dir=f"{swap_dir}/rank{accelerator.process_index}" if kind == "nvme" else None)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    torch.save(weights, f"{out_file}.rank{accelerator.process_index}")
    if kind != "torch":
        opt.optimizer.close()


LAUNCH = """
import sys
sys.path.insert(0, sys.argv[4])
from accelerate import debug_launcher
from test_optim_accelerate_multiprocess import _train
debug_launcher(_train, args=tuple(sys.argv[1:4]), num_processes=2)
"""


@pytest.mark.slow
@pytest.mark.skipif(not FUSED_BITS, reason="torch's fused CPU AdamW uses fused multiply-adds only with AVX2/AVX-512")
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_two_processes_match_torch_fused_adamw(mode, tmp_path):
    # debug_launcher forks: from a fresh interpreter, not from the suite's process, whose threads (torch's, the
    # native core's) a fork copies stopped wherever they were (the CI run hung in it)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for kind in (mode, "torch"):
        proc = subprocess.run([sys.executable, "-c", LAUNCH, kind, str(tmp_path / kind), str(tmp_path), here],
                              env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{mode}.rank{rank}")
        want = torch.load(tmp_path / "torch.rank0")
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
