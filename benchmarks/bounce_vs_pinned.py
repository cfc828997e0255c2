"""Misaligned plain tensor (every byte through bounce buffers) against an aligned pinned one, overwriting one
file with AioHandle, interleaved, as ratios.

    python benchmarks/bounce_vs_pinned.py [--dir .] [--size 512M] [--repeats 5]
"""
import argparse
import os
import time

import torch

from _common import drop_caches, median, print_table  # first: the checkout's swapio
import swapio
from swapio.tools import parse_size


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".")
    p.add_argument("--size", type=parse_size, default=parse_size("512M"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n = args.size
    tensors = {"pinned": swapio.empty_pinned(n, torch.uint8),
               "plain": torch.empty(n + 1, dtype=torch.uint8)[1:]}  # 1 byte past an allocation: misaligned
    for t in tensors.values():
        t.fill_(7)
    path = os.path.join(args.dir, "swapio-bounce-bench.bin")
    gbps = {(k, way): [] for k in tensors for way in ("write", "read")}
    try:
        with swapio.AioHandle() as h:
            h.pwrite(tensors["pinned"], path).wait()  # overwrites from here on: no allocation in the timing
            for rep in range(args.repeats):
                for name in (("pinned", "plain") if rep % 2 == 0 else ("plain", "pinned")):
                    t = tensors[name]
                    start = time.perf_counter()
                    h.pwrite(t, path).wait()
                    gbps[(name, "write")].append(n / (time.perf_counter() - start) / 1e9)
                    drop_caches()
                    start = time.perf_counter()
                    h.pread(t, path).wait()
                    gbps[(name, "read")].append(n / (time.perf_counter() - start) / 1e9)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    rows = []
    for way in ("write", "read"):
        a, b = median(gbps[("plain", way)]), median(gbps[("pinned", way)])
        rows.append((way, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}"))
    print(f"{n >> 20} MiB, GB/s, medians of {args.repeats} interleaved runs, engine {swapio.AioHandle().engine}")
    print_table(("direction", "plain misaligned", "pinned aligned", "plain/pinned"), rows)


if __name__ == "__main__":
    main()
