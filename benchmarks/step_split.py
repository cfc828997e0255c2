"""An offloaded optimizer's step (offload="cpu") over the same elements split into more and more parameters.

    python benchmarks/step_split.py [--total 32M] [--splits 1,8,32,128] [--state-dtype int8] [--repeats 7]

One OffloadAdamW per split, each over --total fp32 elements in that many equal parameters (gradients set once);
their steps are timed in interleaved rounds, each after benchmarks/_common.py's pause, and the script prints
Gparam/s and each split's ratio to the one-parameter step. The step calls the kernel once per parameter, so
the ratio shows what a call costs besides its elements: the Python around it, and the kernel's thread pool
starting its workers (on a virtual machine, waking a sleeping thread costs more than a call of a few MiB).
"""
import argparse

import torch

import _common  # first: the checkout's swapio
import swapio
from swapio.tools import fmt_size, parse_size


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="32M", help="elements in all (default 32M)")
    ap.add_argument("--splits", default="1,8,32,128", help="parameter counts (default 1,8,32,128)")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16", "int8"), default="int8")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    total = parse_size(args.total)
    splits = [int(s) for s in args.splits.split(",")]
    _common.kernel_banner(args.repeats)
    torch.manual_seed(0)
    opts = {}
    for k in splits:
        params = [torch.nn.Parameter(torch.randn(total // k)) for _ in range(k)]
        for p in params:
            p.grad = torch.randn_like(p).mul_(1e-2)
        opts[k] = swapio.optim.OffloadAdamW(params, lr=1e-3, offload="cpu", state_dtype=args.state_dtype)
    times = _common.interleaved_medians({k: opt.step for k, opt in opts.items()}, args.repeats)
    print(f"OffloadAdamW(offload='cpu', state_dtype={args.state_dtype!r}), {fmt_size(total)} elements, "
          f"{torch.get_num_threads()} threads")
    print(" params | elements each | Gparam/s | x one parameter")
    for k in splits:
        rate = (total // k) * k / times[k] / 1e9
        print(f" {k:6d} | {fmt_size(total // k):>13} | {rate:8.2f} | {times[splits[0]] / times[k]:15.2f}")
    for opt in opts.values():
        opt.close()


if __name__ == "__main__":
    main()
