"""CPU cost of the smaller-state kernels per SIMD level: parameters per second of process CPU time, one thread.

On a shared machine the wall clock of adam_kernel.py also counts the time other processes held the core; the
process CPU time of a single-threaded step counts (mostly) this kernel's own cycles. At a cache-resident size
(the default, 64K elements: p, g and the codes fit L2) this is the kernel's compute speed, the ceiling that
adam_kernel.py's memory-bound figures can reach on one core. Best of --repeats, each as many steps as take
about 2e8 elements. The steps take one of four gradients in turn (adam_kernel.py says why).

Usage: python benchmarks/lowp_kernel_cpu.py [--levels scalar,avx2,avx512] [--size 65536] [--repeats 7]
"""
import argparse
import time

import torch

import _common  # noqa: F401  (first: the checkout's swapio)
import swapio.ops as ops
from swapio import quant

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def int8_state(n, moments):
    out = {}
    for name, signed in zip(("exp_avg", "exp_avg_sq")[:moments], (True, False)):
        out[name], out[name + "_scale"] = quant.quantize(torch.randn(n).abs_().mul_(1e-3), signed)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default=",".join(ops.cpu_capabilities()))
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    n = args.size
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).mul_(1e-2) for _ in range(4)]
    m32, v32 = torch.zeros(n), torch.zeros(n)
    a8, l8 = int8_state(n, 2), int8_state(n, 1)
    inner = max(1, int(2e8 // n))
    print(f"size {n}, 1 thread, best of {args.repeats}; Gparam per CPU-second")
    print(f"{'level':8s} {'adam-fp32':>10s} {'adam-int8':>10s} {'lion-int8':>10s}")
    for lvl in args.levels.split(","):
        steps = {
            "adam-fp32": lambda s: ops.adam_step_(p, grads[s % 4], m32, v32, step=s, threads=1, capability=lvl,
                                                  **ADAM),
            "adam-int8": lambda s: ops.adam_step_(p, grads[s % 4], a8["exp_avg"], a8["exp_avg_sq"], step=s,
                                                  threads=1, exp_avg_scale=a8["exp_avg_scale"],
                                                  exp_avg_sq_scale=a8["exp_avg_sq_scale"], capability=lvl, **ADAM),
            "lion-int8": lambda s: ops.lion_step_(p, grads[s % 4], l8["exp_avg"], exp_avg_scale=l8["exp_avg_scale"],
                                                  lr=1e-4, threads=1, capability=lvl),
        }
        row = []
        for step in steps.values():
            reps = inner if lvl != "scalar" else max(1, inner // 20)
            best = float("inf")
            for _ in range(args.repeats):
                t = time.process_time()
                for i in range(reps):
                    step(i + 1)
                best = min(best, (time.process_time() - t) / reps)
            row.append(n / best / 1e9)
        print(f"{lvl:8s} " + " ".join(f"{x:10.2f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
