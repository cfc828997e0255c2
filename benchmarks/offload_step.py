"""One offload="nvme" optimizer step against its parts: the same step's I/O alone and its compute alone.

    python benchmarks/offload_step.py --dir /path/on/nvme [--state-gib 2] [--repeats 5]

The model: bf16 parameters and gradients in RAM; the optimizer keeps an fp32 master and two fp32 moments per
parameter (12 bytes) in a swap file, so --state-gib 2 means ~179 M parameters. After a first step (which
creates the state), the script times, interleaved (step, I/O, compute, step, ...) and reports medians of:
  step     opt.step(): read state chunk i+1 || Adam on chunk i || write chunk i-1, through pinned buffers
  io       the same reads and writes of every state record through the same handles, buffers and pipeline,
           with no compute
  compute  swapio.ops.adam_step_ over the same chunks with the state already in RAM (bf16 grads in, fp32
           master and moments, bf16 params out)
Goal: step <= 1.10 x max(io, compute), i.e. the pipeline hides the smaller of the two behind the larger.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import _common  # noqa: F401  (first: the checkout's swapio)
import swapio
import swapio.optim as so
from swapio import ops

GiB = 1 << 30
MiB = 1 << 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="directory for the swap file (default: the working directory)")
    ap.add_argument("--state-gib", type=float, default=2.0, help="optimizer state size in GiB (default 2)")
    ap.add_argument("--tensors", type=int, default=8, help="parameters the model is split into (default 8)")
    ap.add_argument("--buffer-mib", type=int, default=256, help="pinned buffer budget in MiB (default 256)")
    ap.add_argument("--buffer-count", type=int, default=4, help="pinned buffers in rotation (default 4)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="Adam kernel threads (default: torch's)")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--io-threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)

    numel = int(args.state_gib * GiB) // 12
    numel = (numel + MiB - 1) // MiB * MiB
    per = numel // args.tensors
    torch.manual_seed(0)
    params = [torch.empty(per, dtype=torch.bfloat16).normal_().requires_grad_(True) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.empty_like(p).normal_().mul_(1e-2)
    numel = per * args.tensors
    swap_root = tempfile.mkdtemp(prefix="swapio-bench-", dir=args.dir)
    opt = so.OffloadAdamW(params, lr=1e-4, offload="nvme", swap_dir=swap_root, buffer_bytes=args.buffer_mib * MiB,
                          buffer_count=args.buffer_count, cpu_threads=args.cpu_threads, engine=args.engine,
                          block_size=args.block_size, queue_depth=args.queue_depth, threads=args.io_threads)
    backend = opt._backend
    try:
        t0 = time.perf_counter()
        opt.step()  # creates the state on disk (no reads)
        first = time.perf_counter() - t0
        state_bytes = sum(c.record_bytes for c in backend.chunks)

        # compute alone: the same kernel calls on the same chunk ranges, state in RAM
        # (param_out into copies: writing the optimizer's own parameters made its next step adopt them as changed
        # outside it, a pass over the master that the step measured here does not make)
        flat_p = [p.detach().clone().view(-1) for p in params]
        flat_g = [p.grad.view(-1) for p in params]
        master = [fp.float() for fp in flat_p]
        m = [torch.zeros(per) for _ in params]
        v = [torch.zeros(per) for _ in params]
        index = {p: i for i, p in enumerate(params)}
        ranges = [(index[s.p], s.a, s.b) for c in backend.chunks for s in c.segments]
        step_no = [1]

        def compute():
            step_no[0] += 1
            for i, a, b in ranges:
                ops.adam_step_(master[i][a:b], flat_g[i][a:b], m[i][a:b], v[i][a:b], step=step_no[0], lr=1e-4,
                               beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, adamw=True,
                               param_out=flat_p[i][a:b], threads=args.cpu_threads)

        def io_alone():  # every record read and written back through the step's pipeline, no compute
            backend.run(backend.chunks, lambda chunk: True, lambda chunk, views, slot: None, True)

        def timed(fn):
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

        times = {"step": [], "io": [], "compute": []}
        for _ in range(args.repeats):
            times["step"].append(timed(opt.step))
            times["io"].append(timed(io_alone))
            times["compute"].append(timed(compute))
        med = {k: statistics.median(v) for k, v in times.items()}
        bound = max(med["io"], med["compute"])
        # each round's step against the same round's io and compute (robust to drifts on a shared disk)
        paired = [s / max(i, c) for s, i, c in zip(times["step"], times["io"], times["compute"])]
        result = {
            "state_bytes": state_bytes, "params": numel, "chunks": len(backend.chunks),
            "chunk_elems": max(c.n for c in backend.chunks), "buffer_bytes": args.buffer_mib * MiB,
            "buffer_count": args.buffer_count, "engine": backend.rh.engine,
            "kernel": ops.cpu_capability(), "cpu_threads": args.cpu_threads or torch.get_num_threads(),
            "first_step_s": first, "times_s": times, "median_s": med,
            "io_GBps": 2 * state_bytes / med["io"] / 1e9, "compute_Gparams": numel / med["compute"] / 1e9,
            "step_Gparams": numel / med["step"] / 1e9,
            "ratio": med["step"] / bound, "ratio_paired_median": statistics.median(paired),
            "ratios_paired": paired, "goal": 1.10,
        }
    finally:
        opt.close()
        try:
            os.rmdir(swap_root)
        except OSError:
            pass
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"swapio {swapio.__version__}: one OffloadAdamW nvme step over {state_bytes / GiB:.2f} GiB of state "
          f"({numel / 1e6:.0f} M bf16 params, {result['chunks']} chunks of <= {result['chunk_elems'] / 1e6:.1f} M, "
          f"{args.buffer_count} x {args.buffer_mib // args.buffer_count} MiB pinned buffers, engine "
          f"{result['engine']}, kernel {result['kernel']} x {result['cpu_threads']} threads)")
    print(f"  first step (creates the state, writes only): {first:.3f} s")
    for k in ("step", "io", "compute"):
        runs = " ".join(f"{t:.3f}" for t in times[k])
        print(f"  {k:8s} median {med[k]:.3f} s   runs: {runs}")
    print(f"  io alone: {result['io_GBps']:.2f} GB/s (read + write); compute alone: "
          f"{result['compute_Gparams']:.2f} Gparam/s; step: {result['step_Gparams']:.2f} Gparam/s")
    print(f"  step / max(io, compute) = {result['ratio']:.3f} (medians); per round: "
          f"{' '.join(f'{r:.3f}' for r in paired)}, median {result['ratio_paired_median']:.3f}  "
          f"(goal <= {result['goal']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
