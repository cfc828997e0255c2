"""What a checkpoint of an nvme-resident optimizer state costs the way Hugging Face Trainer and accelerate save
it (torch.save(opt.state_dict()), which reads the whole state into RAM first) against swapio's streaming
opt.save(dir): seconds and peak growth of resident memory, interleaved rounds, medians, ratios.

    python benchmarks/optimizer_checkpoint.py --params 64M --dir . --rounds 3
"""
import argparse
import os
import shutil
import tempfile

import _common  # noqa: F401  (puts the checkout first on sys.path)
import torch

import swapio.optim as so
from swapio.tools import parse_size


def peak_growth(fn):
    """(seconds, peak resident growth in bytes) of fn()."""
    seconds, growth, _ = _common.timed_with_peak_rss(fn)
    return seconds, growth


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="64M", help="fp32 parameters (K/M/G binary suffixes; default 64M)")
    ap.add_argument("--dir", default=".", help="directory for the swap file and the checkpoints")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = parse_size(args.params)
    work = tempfile.mkdtemp(prefix="swapio-ckpt-bench-", dir=args.dir)
    try:
        p = torch.zeros(n, requires_grad=True)
        p.grad = torch.randn(n)
        opt = so.OffloadAdamW([p], offload="nvme", swap_dir=work, buffer_bytes=64 << 20)
        opt.step()
        p.grad = None
        state_bytes = 8 * n
        results = {"torch.save(state_dict())": [], "opt.save(dir)": []}

        def torch_save():
            torch.save(opt.state_dict(), os.path.join(work, "optimizer.pt"))

        def swapio_save():
            opt.save(os.path.join(work, "swapio-optim"))

        for r in range(args.rounds):
            order = [("torch.save(state_dict())", torch_save), ("opt.save(dir)", swapio_save)]
            for name, fn in (order if r % 2 == 0 else order[::-1]):
                results[name].append(peak_growth(fn))
        opt.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"nvme-resident AdamW state of {n / 1e6:.0f} M fp32 parameters: {state_bytes / 2**20:.0f} MiB; "
          f"{args.rounds} interleaved rounds, medians")
    rows = []
    for name, runs in results.items():
        sec = _common.median([s for s, _ in runs])
        mem = _common.median([m for _, m in runs])
        rows.append((name, f"{sec:.2f}", f"{mem / 2**20:.0f}", f"{state_bytes / sec / 1e9:.2f}"))
    _common.print_table(("save", "seconds", "peak RSS growth MiB", "GB/s of state"), rows)
    t = {name: _common.median([s for s, _ in runs]) for name, runs in results.items()}
    m = {name: _common.median([x for _, x in runs]) for name, runs in results.items()}
    print(f"opt.save / torch.save: time {t['opt.save(dir)'] / t['torch.save(state_dict())']:.2f}x, "
          f"peak RSS growth {m['opt.save(dir)'] / max(m['torch.save(state_dict())'], 1):.3f}x")


if __name__ == "__main__":
    main()
