"""What glibc's MALLOC_MMAP_THRESHOLD_ costs a CPU training loop: docs/offload.md suggests it to keep the host
memory of offloaded training from growing with depth, and this is the price.

    python benchmarks/malloc_threshold_cost.py [--threshold 1048576] [--layers 8] [--tokens 2048] [--steps 7]

A resident bf16 MLP stack (Linear 1024 -> 2816, SiLU, Linear 2816 -> 1024, the width of a 1024-wide Llama's MLP)
runs forward + backward on --tokens tokens, in two fresh processes: glibc's default (its mmap threshold rises
to the largest freed block, so autograd's temporaries come from the heap and stay there) and a fixed threshold
(every allocation above it a fresh mmap, given back at free: page faults each time). Prints each median step
and the ratio, measured in the same run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import REPO  # noqa: F401  (the checkout first)


def child(args):
    import torch
    torch.manual_seed(0)
    width, hidden = 1024, 2816
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.SiLU(),
                                                      torch.nn.Linear(hidden, width))
                                  for _ in range(args.layers)]).to(torch.bfloat16)
    x = torch.randn(args.tokens, width, dtype=torch.bfloat16)

    def step():
        model(x).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps(statistics.median(times)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threshold", type=int, default=1 << 20)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    results = {}
    for name in ("default", "fixed", "default", "fixed"):  # interleaved: drift hits both alike
        env = dict(os.environ)
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        if name == "fixed":
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.threshold)
        out = subprocess.run([sys.executable, __file__, "--child", "--layers", str(args.layers), "--tokens",
                              str(args.tokens), "--steps", str(args.steps)], env=env, check=True,
                             capture_output=True, text=True).stdout
        results.setdefault(name, []).append(json.loads(out.strip().splitlines()[-1]))
    default, fixed = min(results["default"]), min(results["fixed"])
    print(f"{args.layers} layers, {args.tokens} tokens, bf16, forward + backward; best of two processes each")
    print(f"  glibc default:                      {default:.3f} s a step")
    print(f"  MALLOC_MMAP_THRESHOLD_={args.threshold}: {fixed:.3f} s a step ({fixed / default:.2f} x default)")


if __name__ == "__main__":
    main()
