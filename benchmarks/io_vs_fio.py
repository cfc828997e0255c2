"""swapio's AioHandle against fio on the same file, interleaved, as ratios; and the plain-tensor path
against the aligned pinned path.

    python benchmarks/io_vs_fio.py [--dir .] [--size 2G] [--repeats 5] [--tensor-size 512M]

Sequential write and read at 1 MiB and 128 KiB blocks, queue depth 32, O_DIRECT. Each repeat runs every
contender once, in a rotating order (these machines are noisy: compare medians of interleaved runs).
fio: the command `swapio bench --compare-fio` runs (swapio.tools.fio_command / run_fio), with --ioengine=libaio|io_uring.
"""
import argparse
import json
import os
import sys
import time

import torch

from _common import drop_caches, median, print_table  # first: the checkout's swapio
import swapio
import swapio.tools as fio
from swapio.tools import parse_size

CONFIGS = [(1 << 20, 32), (128 << 10, 32)]
FIO_CONTENDERS = {"fio-libaio": "aio", "fio-io_uring": "uring"}  # fio's engine as swapio names it


def fio_gbps(path, rw, bs, qd, size, engine):
    """One whole-file fio pass: the command `swapio bench --compare-fio` runs, with one job and 1 loop."""
    cmd = fio.fio_command(fio.find_fio(), path=path, rw=rw, bs=bs, iodepth=qd, threads=1,
                                 size=size, engine=engine, direct=True)
    return fio.run_fio(cmd)[rw]["bw_bytes"] / 1e9


def swapio_gbps(path, rw, bs, qd, buf):
    with swapio.AioHandle(block_size=bs, queue_depth=qd, direct=True) as h:
        start = time.perf_counter()
        (h.pwrite if rw == "write" else h.pread)(buf, path).wait()
        return buf.numel() / (time.perf_counter() - start) / 1e9


def disk_vs_fio(args):
    path = os.path.join(args.dir, "swapio-vs-fio.bin")
    buf = swapio.empty_pinned(args.size, torch.uint8)
    buf.random_(0, 256)
    contenders = ["swapio", "fio-libaio", "fio-io_uring"]
    results = {}  # (rw, bs, contender) -> [GB/s]
    try:
        swapio_gbps(path, "write", 1 << 20, 32, buf)  # lay the file out once
        for rep in range(args.repeats):
            order = contenders[rep % 3:] + contenders[:rep % 3]
            for bs, qd in CONFIGS:
                for rw in ("write", "read"):
                    for who in order:
                        if rw == "read":
                            drop_caches()
                        if who == "swapio":
                            gbps = swapio_gbps(path, rw, bs, qd, buf)
                        else:
                            gbps = fio_gbps(path, rw, bs, qd, args.size, FIO_CONTENDERS[who])
                        results.setdefault((rw, bs, who), []).append(gbps)
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    rows, summary = [], {}
    for bs, qd in CONFIGS:
        for rw in ("write", "read"):
            med = {who: median(results[(rw, bs, who)]) for who in contenders}
            best_fio = max(med["fio-libaio"], med["fio-io_uring"])
            ratio = med["swapio"] / best_fio
            summary[f"{rw} {bs >> 10}K QD{qd}"] = {**med, "ratio": ratio}
            rows.append((f"seq {rw}", f"{bs >> 10}K", qd, f"{med['swapio']:.2f}", f"{med['fio-libaio']:.2f}",
                         f"{med['fio-io_uring']:.2f}", f"{ratio:.2f}"))
    print(f"\nGB/s (10^9 B/s), medians of {args.repeats} interleaved runs, {args.size >> 20} MiB file, O_DIRECT")
    print_table(("workload", "bs", "QD", "swapio", "fio libaio", "fio io_uring", "swapio/best fio"), rows)
    return summary


def tensor_paths(args):
    """Swap a plain, deliberately misaligned tensor out and in, against an aligned pinned one."""
    n = args.tensor_size
    plain = torch.empty(n + 1, dtype=torch.uint8)[1:]  # starts 1 byte past an allocation: misaligned
    pinned = swapio.empty_pinned(n, torch.uint8)
    plain.random_(0, 256)
    pinned.copy_(plain)
    results = {"plain": {"out": [], "in": []}, "pinned": {"out": [], "in": []}}
    directory = os.path.join(args.dir, "swapio-tensor-bench")
    with swapio.SwapStore(directory, block_size=1 << 20, queue_depth=32) as store:
        for rep in range(args.repeats):
            for kind in (("plain", "pinned") if rep % 2 == 0 else ("pinned", "plain")):
                t = plain if kind == "plain" else pinned
                start = time.perf_counter()
                s = store.swap_out(t, name=kind, release=False).wait()
                results[kind]["out"].append(n / (time.perf_counter() - start) / 1e9)
                drop_caches()
                start = time.perf_counter()
                s.swap_in(out=t).wait()
                results[kind]["in"].append(n / (time.perf_counter() - start) / 1e9)
                store.remove(s)
    assert torch.equal(plain, pinned), "tensor round trip changed the bytes"
    rows, summary = [], {}
    for way in ("out", "in"):
        p, a = median(results["plain"][way]), median(results["pinned"][way])
        summary[f"swap_{way}"] = {"plain": p, "pinned": a, "ratio": p / a}
        rows.append((f"swap_{way}", f"{p:.2f}", f"{a:.2f}", f"{p / a:.2f}"))
    print(f"\nTensor path, {n >> 20} MiB, GB/s, medians of {args.repeats} interleaved runs")
    print_table(("direction", "plain misaligned", "pinned aligned", "plain/pinned"), rows)
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".", help="directory on the disk to test (default: working directory)")
    p.add_argument("--size", type=parse_size, default=parse_size("2G"), help="file size (default 2G)")
    p.add_argument("--tensor-size", type=parse_size, default=parse_size("512M"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-fio", action="store_true", help="only the tensor-path comparison")
    p.add_argument("--json", metavar="FILE", help="also write the medians and ratios as JSON")
    args = p.parse_args()
    summary = {"engine": swapio.AioHandle().engine}
    if not args.skip_fio:
        try:
            fio.find_fio()
        except fio.FioError as e:
            sys.exit(f"{e}; use --skip-fio for the tensor path only")
        summary["disk"] = disk_vs_fio(args)
    summary["tensor"] = tensor_paths(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
