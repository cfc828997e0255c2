"""CPU Adafactor step throughput: swapio's kernel against torch.optim.Adafactor and the memory-bandwidth bound.

For each shape and thread count, every method steps its own copy of one parameter with the same gradient, taking
turns (A B C A B C ...) so that drift on a noisy machine hits all alike; the table shows medians.

  swapio        swapio.ops.adafactor_step_ (the native kernel, at the SIMD level printed in the header)
  torch-loop    torch.optim.Adafactor() (its default: the single-tensor loop)
  torch-foreach torch.optim.Adafactor(foreach=True)
  bound         a STREAM-style triad a = b + s*c timed with torch in the same run (12 bytes per element, as STREAM
                counts it) divided by the bytes a step must move. torch's algorithm needs three passes over the
                parameter, as the norms come before the update: a matrix reads g and p (the sums of squares),
                g again (the update's norm), then g and p and writes p: 24 bytes a parameter; a vector (1-D)
                folds the first into the second, which also reads and writes the second moment: 16 + 16 = 32.
                An in-place update has no write-allocate traffic, so a kernel at the memory limit can exceed it.

Usage: python benchmarks/adafactor_kernel.py [--shapes 4096x4096,16777216] [--threads 1,2] [--repeats 5]
"""
import argparse
import math

import torch

import _common  # first: the checkout's swapio
import swapio.ops as sops
from swapio.kernels.adafactor_ops import factored_dims

HYPER = dict(lr=1e-2, weight_decay=1e-2)


def run_bench(shape, threads, repeats):
    torch.set_num_threads(threads)
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen).mul_(1e-2)
    dims = factored_dims(shape)
    state = ({"row_var": torch.zeros(dims[0] * dims[1]), "col_var": torch.zeros(dims[0] * dims[2])} if dims
             else {"variance": torch.zeros(n)})
    mine = p0.clone().reshape(-1)
    step = [0]

    def swapio_step():
        step[0] += 1
        sops.adafactor_step_(mine, g.reshape(-1), shape=shape, step=step[0], threads=threads, **state, **HYPER)

    def torch_opt(**kw):
        param = torch.nn.Parameter(p0.clone())
        param.grad = g
        return torch.optim.Adafactor([param], **HYPER, **kw)

    loop, foreach = torch_opt(), torch_opt(foreach=True)
    ta, tb, tc = torch.empty(n), torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def triad():
        torch.add(tb, tc, alpha=3.0, out=ta)

    fns = {"swapio": swapio_step, "torch-loop": loop.step, "torch-foreach": foreach.step, "triad": triad}
    return _common.interleaved_medians(fns, repeats), 24 if dims else 32


def parse_shape(text):
    return tuple(int(d) for d in text.lower().split("x"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x4096,16777216", help="parameter shapes, comma-separated (AxB, A)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per method (interleaved)")
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    _common.kernel_banner(args.repeats)
    hdr = (f"{'shape':>12} {'thr':>3} | {'swapio':>7} {'loop':>7} {'foreach':>7} {'bound':>7} | "
           f"{'x loop':>7} {'x forea':>7} {'%bound':>6} | {'triad GB/s':>10}")
    print(hdr)
    print("-" * len(hdr))
    for shape in shapes:
        n = math.prod(shape)
        for t in threads:
            med, per_param = run_bench(shape, t, args.repeats)
            rate = {k: n / s / 1e9 for k, s in med.items()}
            bw = 12 * n / med["triad"]
            bound = bw / per_param / 1e9
            print(f"{'x'.join(map(str, shape)):>12} {t:>3} | {rate['swapio']:7.3f} {rate['torch-loop']:7.3f} "
                  f"{rate['torch-foreach']:7.3f} {bound:7.3f} | {rate['swapio'] / rate['torch-loop']:7.2f} "
                  f"{rate['swapio'] / rate['torch-foreach']:7.2f} {100 * rate['swapio'] / bound:5.0f}% | "
                  f"{bw / 1e9:10.1f}", flush=True)
    print("columns: Gparam/s of the step; x = swapio's ratio; bound = triad bandwidth / 24 B per param (matrix) "
          "or 32 (vector)")


if __name__ == "__main__":
    main()
