"""The offload="nvme" step of one model with fp32, bf16 and int8 optimizer state, timed interleaved in one run.

    python benchmarks/state_dtype_step.py --dir /path/on/nvme [--state-gib 1] [--repeats 5] [--optimizer adamw]

The model: bf16 parameters and gradients in RAM, split into --tensors parameters; --state-gib is the size of
the fp32 state (master + moments: 12 bytes a parameter for AdamW), so each optimizer moves the same parameters.
Three optimizers, one per state_dtype, each with its own swap file and pinned buffers, take a first step (which
creates their state); then their steps are timed in rounds (fp32, bf16, int8, fp32, ...), and the script prints
the median step of each, its ratio to the fp32 step (each round's own, then their median), the bytes read and
written per parameter (opt.memory_report()), and the CPU time of the step's kernel alone (the state in RAM),
which bounds how far fewer bytes can help.
Goals: int8 <= 0.55 x the fp32-state step, bf16 <= 0.75 x.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

import _common  # noqa: F401  (first: the checkout's swapio)
import swapio
import swapio.optim as so
from swapio import ops, quant

GiB, MiB = 1 << 30, 1 << 20
DTYPES = ("fp32", "bf16", "int8")
GOALS = {"bf16": 0.75, "int8": 0.55}


def _kernel_alone(kind, state_dtype, n, threads):
    """Seconds of one kernel pass over n elements with the state in RAM (bf16 grad in, bf16 param out)."""
    g = torch.randn(n).mul_(1e-2).to(torch.bfloat16)
    master, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    moments = ("exp_avg",) if kind == "lion" else ("exp_avg", "exp_avg_sq")
    st = {}
    for name in moments:
        if state_dtype == "int8":
            st[name], st[name + "_scale"] = torch.zeros(n, dtype=torch.uint8), torch.zeros(quant.num_blocks(n))
        else:
            st[name] = torch.zeros(n, dtype=torch.float32 if state_dtype == "fp32" else torch.bfloat16)
    kw = dict(step=2, param_out=out, threads=threads, exp_avg_scale=st.get("exp_avg_scale"))
    t = time.perf_counter()
    if kind == "lion":
        ops.lion_step_(master, g, st["exp_avg"], lr=1e-4, **kw)
    else:
        ops.adam_step_(master, g, st["exp_avg"], st["exp_avg_sq"], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.01, exp_avg_sq_scale=st.get("exp_avg_sq_scale"), **kw)
    return time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="directory for the swap files (default: the working directory)")
    ap.add_argument("--state-gib", type=float, default=1.0, help="fp32 state size in GiB (default 1)")
    ap.add_argument("--tensors", type=int, default=8, help="parameters the model is split into (default 8)")
    ap.add_argument("--optimizer", choices=("adamw", "lion"), default="adamw")
    ap.add_argument("--buffer-mib", type=int, default=256, help="pinned buffers per optimizer, MiB (default 256)")
    ap.add_argument("--cpu-threads", type=int, default=None, help="kernel threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)

    per_param = 12 if args.optimizer == "adamw" else 8
    per = int(args.state_gib * GiB) // per_param // args.tensors // MiB * MiB
    numel = per * args.tensors
    torch.manual_seed(0)
    params = [torch.empty(per, dtype=torch.bfloat16).normal_().requires_grad_(True) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.empty_like(p).normal_().mul_(1e-2)

    def own_copy():  # each optimizer its own parameters: one stepping another's would make every step adopt the
        # other's writes as changes made outside it (a pass over the master), which is not the step measured here
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        for c, p in zip(copies, params):
            c.grad = p.grad
        return copies
    cls = so.OffloadAdamW if args.optimizer == "adamw" else so.OffloadLion
    root = tempfile.mkdtemp(prefix="swapio-bench-", dir=args.dir)
    opts = {}
    try:
        for dtype in DTYPES:
            opts[dtype] = cls(own_copy(), lr=1e-4, offload="nvme", swap_dir=root, state_dtype=dtype,
                              buffer_bytes=args.buffer_mib * MiB, cpu_threads=args.cpu_threads)
            opts[dtype].step()  # creates the state on disk (writes only)
        times = {d: [] for d in DTYPES}
        for _ in range(args.repeats):
            for dtype in DTYPES:
                t = time.perf_counter()
                opts[dtype].step()
                times[dtype].append(time.perf_counter() - t)
        reports = {d: opts[d].memory_report() for d in DTYPES}
    finally:
        for opt in opts.values():
            opt.close()
    threads = args.cpu_threads or torch.get_num_threads()
    kernel = {d: numel / per * _kernel_alone(args.optimizer, d, per, threads) for d in DTYPES}
    med = {d: statistics.median(v) for d, v in times.items()}
    paired = {d: statistics.median(t / f for t, f in zip(times[d], times["fp32"])) for d in DTYPES}
    result = {"optimizer": args.optimizer, "params": numel, "repeats": args.repeats, "median_s": med,
              "times_s": times, "ratio_to_fp32": paired, "goal": GOALS, "kernel_s": kernel,
              "io_bytes_per_param": {d: reports[d]["io_bytes_per_step"] / numel for d in DTYPES},
              "kernel_isa": ops.cpu_capability(), "cpu_threads": threads}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"swapio {swapio.__version__}: Offload{args.optimizer.capitalize()} nvme step, {numel / 1e6:.0f} M bf16 "
          f"params in {args.tensors} tensors, {args.buffer_mib} MiB pinned buffers each, kernel "
          f"{result['kernel_isa']} x {threads} threads, {args.repeats} interleaved rounds")
    print(f"  {'state':6s} {'bytes/param moved':>18s} {'step (median)':>14s} {'/ fp32 step':>12s} {'goal':>6s} "
          f"{'kernel alone':>13s}")
    for d in DTYPES:
        goal = f"{GOALS[d]:.2f}" if d in GOALS else ""
        print(f"  {d:6s} {result['io_bytes_per_param'][d]:18.2f} {med[d]:13.3f}s {paired[d]:12.3f} {goal:>6s} "
              f"{kernel[d]:12.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
