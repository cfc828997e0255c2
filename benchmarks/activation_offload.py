"""Activation offload: step time and activation memory with and without swapio.offload.offload_activations.

    python benchmarks/activation_offload.py [--dir /nvme/act] [--layers 6 --width 256 --heads 8 --seq 1024
                                            --batch 2] [--steps 4] [--rounds 2] [--pairs 8] [--staging-mib 64]
                                            [--prefetch 4]
                                            [--gpu-only | --cpu-only]

CPU (always): a GPT-2 (transformers, random init, fp32, eager attention) trained on long sequences, forward +
backward, each mode in a fresh process (so peak RSS is its own): no offload, then to="nvme" in --dir, the two
interleaved --rounds times; then both in one process, --pairs blocks of steps none, none, nvme, nvme (the second
of each pair timed: each follows a step of its own mode, and the two are seconds apart, so that other jobs on the
machine slow both alike: on a shared 2-core machine a 2-thread step ran 0.7 s or 3 s as they came and went).
Printed:
  step time (own processes: median of --steps after one warm-up step, the best round of each mode; one process:
    the blocks' medians) and the ratio nvme / none (one process: the median of the blocks' ratios, and their
    range); goal <= 1.15 when the disk's time for the activations (bytes / write bandwidth + bytes / read
    bandwidth, measured in the same run with swapio's handle on --dir) is below the compute;
  activation RSS: the growth of peak RSS (VmHWM, reset before the step; malloc returns big blocks at once,
    MALLOC_MMAP_THRESHOLD_) during the step, the parameters' gradients taken off, plus (to="nvme") the read
    buffers the offload kept from the step before (resident before the step, so not in the growth); goal with
    to="nvme": <= the staging bytes + 2 layers' saved tensors (one layer's: the bytes a forward saves / layers,
    counted with saved-tensor hooks).
GPU (when CUDA is available): the same model on the GPU, to="cpu" vs no offload vs
torch.autograd.graph.save_on_cpu(pin_memory=True), step time ratios and the GPU's activation peak
(max_memory_allocated during the step minus before it).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from _common import proc_status, reset_peak_rss  # first: puts the checkout first on sys.path

CHILD = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
import activation_offload as bench
print(json.dumps(bench.child(json.loads(sys.argv[1]))))
"""


def build(args, device="cpu"):
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=args["width"], n_layer=args["layers"], n_head=args["heads"],
                                     n_positions=args["seq"], vocab_size=8192, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    ids = torch.randint(0, 8192, (args["batch"], args["seq"]), generator=torch.Generator().manual_seed(1))
    return model, ids.to(device)


def saved_bytes(model, ids):
    """Bytes of the distinct storages one forward saves for backward, parameters and buffers aside."""
    import torch
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss
    return sum(seen.values())



def paired(args):
    """Step times of no offload and to="nvme" in one process, in blocks none, none, nvme, nvme: the second step of
    each pair is timed, so each mode's timed step follows one of its own (as in training: the work an offloaded
    step leaves to the kernel lands in the next offloaded step) while the two stay close in time (other jobs on
    the machine hit both alike). Returns [(none_s, nvme_s)] per block."""
    import contextlib

    import torch
    from swapio.offload import offload_activations
    torch.set_num_threads(args["threads"])
    model, ids = build(args)
    own = {} if args["prefetch"] is None else {"prefetch": args["prefetch"]}
    modes = {"none": contextlib.nullcontext(),
             "nvme": offload_activations(to="nvme", swap_dir=args["dir"], model=model, staging_bytes=args["staging"],
                                         min_bytes=args["min_bytes"], **own)}
    blocks = []
    for _ in range(args["pairs"] + 1):  # the first block warms up
        timed = {}
        for mode in ("none", "none", "nvme", "nvme"):
            model.zero_grad(set_to_none=False)
            t0 = time.perf_counter()
            with modes[mode]:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            timed[mode] = time.perf_counter() - t0
            del loss
        blocks.append((timed["none"], timed["nvme"]))
    modes["nvme"].close()
    return {"blocks": blocks[1:]}


def child(args):
    """One mode in this process: step times, activation RSS (CPU) or GPU activation peak."""
    import contextlib

    import torch
    from swapio.offload import offload_activations
    if args["mode"] == "paired":
        return paired(args)
    torch.set_num_threads(args["threads"])
    device = args["device"]
    model, ids = build(args, device)
    mode = args["mode"]
    own = {} if args["prefetch"] is None else {"prefetch": args["prefetch"]}
    if mode == "nvme":
        ctx = offload_activations(to="nvme", swap_dir=args["dir"], model=model, staging_bytes=args["staging"],
                                  min_bytes=args["min_bytes"], **own)
    elif mode == "cpu":
        ctx = offload_activations(to="cpu", model=model, min_bytes=args["min_bytes"], **own)
    elif mode == "save_on_cpu":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
    else:
        ctx = contextlib.nullcontext()
    out = {"mode": mode, "saved_bytes": saved_bytes(model, ids)}
    times, peaks = [], []

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()
    for step in range(args["steps"] + 1):
        model.zero_grad(set_to_none=False)
        sync()
        if device == "cpu":
            reset_peak_rss()
            base = proc_status("VmRSS") - (ctx.stats().get("read_buffer_bytes", 0) if mode == "nvme" else 0)
        else:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        peaks.append((proc_status("VmHWM") if device == "cpu" else torch.cuda.max_memory_allocated()) - base)
        del loss
    out["step_s"] = sorted(times[1:])[len(times[1:]) // 2]
    out["peak"] = max(peaks[1:])
    if mode in ("nvme", "cpu"):
        out["stats"] = ctx.stats()
        ctx.close()
    return out


def run_child(args, **overrides):
    spec = {**args, **overrides}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
    code = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{spec['mode']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, Linux {platform.release()}"


def mib(n):
    return f"{n / (1 << 20):.0f} MiB"


def cpu_part(args):
    from swapio.tools.plan import measured_bandwidth
    read_bw, write_bw, how = measured_bandwidth(args["dir"], size=256 << 20)
    rows, rounds = {}, []
    for _ in range(args["rounds"]):  # interleaved: drift and other jobs hit both
        pair = {mode: run_child(args, mode=mode, device="cpu") for mode in ("none", "nvme")}
        rounds.append(pair["nvme"]["step_s"] / pair["none"]["step_s"])
        for mode, r in pair.items():
            if mode not in rows or r["step_s"] < rows[mode]["step_s"]:
                rows[mode] = r
    none, nvme = rows["none"], rows["nvme"]
    blocks = run_child(args, mode="paired", device="cpu")["blocks"]
    grads = 4 * sum_params(args)
    per_layer = none["saved_bytes"] / args["layers"]
    offloaded = nvme["stats"]["bytes"] / (args["steps"] + 1)  # per forward (the warm-up step counted too)
    disk_s = offloaded / write_bw + offloaded / read_bw
    compute_s = none["step_s"]
    print(f"CPU: GPT-2 {args['layers']} layers x {args['width']} wide, {args['heads']} heads, batch {args['batch']} x "
          f"seq {args['seq']}, fp32, {args['threads']} threads; disk {args['dir']}: read {read_bw / 1e9:.2f} GB/s, "
          f"write {write_bw / 1e9:.2f} GB/s ({how})")
    print(f"  saved per forward {mib(none['saved_bytes'])} ({mib(per_layer)} a layer); offloaded per forward "
          f"{mib(offloaded)}; disk time for them "
          f"{disk_s:.2f} s vs compute {compute_s:.2f} s ({'below' if disk_s < compute_s else 'ABOVE'} the compute)")
    bound = args["staging"] + 2 * per_layer
    for name, r in (("no offload", none), ('to="nvme"', nvme)):
        print(f"  {name:12} step {r['step_s']:.3f} s (own process, best of {args['rounds']})   activation RSS "
              f"{mib(r['peak'] - grads)}")
    print(f"  own processes: step ratio nvme / none = {nvme['step_s'] / none['step_s']:.3f}; each round: "
          f"{', '.join(f'{r:.3f}' for r in rounds)}")
    ratios = sorted(b / a for a, b in blocks)
    steps = [sorted(x)[len(x) // 2] for x in zip(*blocks)]
    print(f"  one process, {len(blocks)} blocks none, none, nvme, nvme: median step none {steps[0]:.3f} s, nvme "
          f"{steps[1]:.3f} s; step ratio nvme / none = {ratios[len(ratios) // 2]:.3f} (median of the blocks' ratios; "
          f"they ranged {ratios[0]:.3f}-{ratios[-1]:.3f}) (goal <= 1.15 when the disk's time is below the "
          f"compute); load average {os.getloadavg()[0]:.2f}")
    print(f"  activation RSS nvme = {mib(nvme['peak'] - grads)} vs bound staging {mib(args['staging'])} + 2 layers "
          f"{mib(2 * per_layer)} = {mib(bound)}: ratio {(nvme['peak'] - grads) / bound:.2f} (goal <= 1); "
          f"no offload / nvme = {(none['peak'] - grads) / max(nvme['peak'] - grads, 1):.1f}x")


def sum_params(args):
    model, _ = build(args)
    return sum(p.numel() for p in model.parameters())


def gpu_part(args):
    import torch
    if not torch.cuda.is_available():
        print("GPU: skipped (no CUDA here)")
        return
    rows = {}
    for mode in ("none", "cpu", "save_on_cpu") * args["rounds"]:
        r = run_child(args, mode=mode, device="cuda")
        if mode not in rows or r["step_s"] < rows[mode]["step_s"]:
            rows[mode] = r
    per_layer = rows["none"]["saved_bytes"] / args["layers"]
    print(f"GPU: {torch.cuda.get_device_name(0)}; saved per forward {mib(rows['none']['saved_bytes'])} "
          f"({mib(per_layer)} a layer)")
    for mode, name in (("none", "no offload"), ("cpu", 'to="cpu"'), ("save_on_cpu", "save_on_cpu(pin)")):
        r = rows[mode]
        print(f"  {name:16} step {r['step_s']:.4f} s   GPU peak during the step {mib(r['peak'])}")
    base = rows["none"]["step_s"]
    print(f"  step ratio to=\"cpu\" / none = {rows['cpu']['step_s'] / base:.3f} (goal <= 1.05); save_on_cpu / none = "
          f"{rows['save_on_cpu']['step_s'] / base:.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="swap directory for to=\"nvme\" (default: a temporary one here)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="interleaved runs of each mode in its own process")
    p.add_argument("--pairs", type=int, default=8, help="blocks none, none, nvme, nvme in one process")
    p.add_argument("--prefetch", type=int, default=None, help="offload_activations' prefetch (default: its own)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--staging-mib", type=int, default=64)
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu-only", action="store_true")
    g.add_argument("--cpu-only", action="store_true")
    a = p.parse_args()
    print(f"machine: {machine()}")
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)  # a swap directory that does not exist yet is made, as the library does
    with tempfile.TemporaryDirectory(dir=a.dir or ".") as tmp:
        args = dict(dir=tmp, layers=a.layers, width=a.width, heads=a.heads, seq=a.seq, batch=a.batch,
                    steps=a.steps, threads=a.threads, staging=a.staging_mib << 20, min_bytes=a.min_bytes,
                    rounds=a.rounds, pairs=a.pairs, prefetch=a.prefetch)
        if not a.gpu_only:
            cpu_part(args)
        if not a.cpu_only:
            gpu_part(args)


if __name__ == "__main__":
    main()
