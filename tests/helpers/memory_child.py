"""Child side of test_optim_memory_small: the growth of a process's peak RSS over two AdamW steps of a small
model in one offload mode. Imported once by the fork server (preload)."""
import json

import torch

import swapio.optim as so
from helpers.rss_child import reset_peak, status


def peak_growth(mode, swap_dir, shapes, result_path):
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
    with open(result_path, "w") as f:
        json.dump({"growth": peak - baseline, "reset": reset, "report": report}, f)
