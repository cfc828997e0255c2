"""Training a model whose weights, gradients and Adam state do not fit in RAM: disk_offload + OffloadAdamW(nvme).

    python benchmarks/offload_training.py [--dir /tmp/offload/train] [--layers 26 --width 2560] [--steps 3]
                                          [--tokens 32] [--modes accumulate,in_backward]

The model is a GPT-2 built on meta from a transformers config (bf16 weights; by default 26 layers x 2560 wide:
2.2 G parameters), read from a safetensors checkpoint the benchmark writes once (random weights, streamed).
Weights (bf16) + fp32 gradient sums + fp32 master and moments take 18 bytes a parameter: 39 GB by default, over
1.5x this machine's RAM is the point (the script prints the ratio). Each mode runs in a fresh process:
  disk_offload(meta model, checkpoint=..., offload_dir=...) and OffloadAdamW(offload="nvme", swap_dir=...,
  in_backward=False (accumulate: gradients summed in a file beside the state, then step) or True (each module
  updated during backward, the gradient never stored)); one micro-batch (1 x --tokens) a step, --steps steps.
  The first step creates the state (the fp32 masters from the weights) and is reported, not counted.
Per step it prints forward, backward and step seconds, bytes read and written (/proc/self/io: what reached the
disk), and peak RSS (VmHWM, reset every step). The bound of a step, measured in the same run:
  I/O    bytes read / the best read bandwidth + bytes written / the best write bandwidth of swapio's handle (a
         file of --bw-gib GiB overwritten and read back with O_DIRECT, two handle configurations; overwritten,
         as training overwrites its files: extending a file is slower on this disk);
  compute  forward + backward of one resident layer of the same shape x layers, + the embedding and head, + the
         Adam kernel (OffloadAdamW in cpu mode on a resident bf16 tensor) scaled to the parameter count;
  bound = max(I/O, compute). Goals: accumulate step <= 1.25 x bound; in_backward <= 0.75 x accumulate.
Host memory: per step, the growth of peak RSS from before disk_offload, VmLck and swapio's own pinned peak
(core/pinned.py, which counts memory the kernel refused to lock too), against memory_report()["pinned_budget"]
and the RAM row `swapio plan` gives for the same options. --memory runs only that, e.g. a Llama at two depths:
    python benchmarks/offload_training.py --memory --arch llama --width 1024 --vocab 32000 --layers 8 \
        --ring-mib 64 --buffer-mib 64 --steps 2 --modes accumulate --dir /tmp/offload/llama8
DeepSpeed ZeRO-3 with offload_param + offload_optimizer on NVMe (benchmarks/_deepspeed_zero3.py) runs on the same
shapes and steps in --deepspeed-python (a venv with deepspeed; its async_io op needs libaio-dev); where it does
not run, the reason is printed.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from _common import REPO, io_bytes, print_table, proc_status, reset_peak_rss  # first: the checkout's swapio
from param_offload import _meta_model, write_checkpoint

GiB = 1 << 30
CONFIGS = [dict(block_size=1 << 20, queue_depth=32, threads=1), dict(block_size=4 << 20, queue_depth=16, threads=2)]


def child_train(args):
    import torch
    from swapio.offload import disk_offload
    from swapio.optim import OffloadAdamW
    in_backward = args.child == "in_backward"
    od, swap = os.path.join(args.dir, f"od-{args.child}"), os.path.join(args.dir, f"swap-{args.child}")
    for d in (od, swap):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    from swapio.core.pinned import pinned_bytes
    model = _meta_model(args)
    largest = max(sum(p.numel() * p.element_size() for p in m._parameters.values() if p is not None)
                  for m in model.modules())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reset_peak_rss()
    base_rss = proc_status("VmRSS")  # before disk_offload: its ring counts
    t0 = time.perf_counter()
    disk_offload(model, checkpoint=os.path.join(args.dir, "model.safetensors"), offload_dir=od,
                 buffer_bytes=args.ring_mib << 20)
    opt = OffloadAdamW(model.parameters(), lr=1e-5, offload="nvme", swap_dir=swap, in_backward=in_backward,
                       buffer_bytes=args.buffer_mib << 20)
    setup_s = time.perf_counter() - t0  # includes moving the trained weights out of the checkpoint
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    steps = []
    for _ in range(args.steps):
        reset_peak_rss()
        pinned_bytes(reset_peak=True)
        r0, w0 = io_bytes()
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        r1, w1 = io_bytes()
        steps.append(dict(loss=float(loss.detach()), forward_s=t1 - t0, backward_s=t2 - t1, step_s=t3 - t2, total_s=t3 - t0,
                          read=r1 - r0, written=w1 - w0, peak_rss=proc_status("VmHWM"),
                          rss_growth=proc_status("VmHWM") - base_rss, locked=proc_status("VmLck"),
                          pinned_peak=pinned_bytes()[1]))
        print(json.dumps(steps[-1]), file=sys.stderr, flush=True)
    report = opt.memory_report()
    opt.close()
    return dict(setup_s=setup_s, steps=steps, memory=report, largest_module=largest, weight_bytes=weight_bytes)


def print_memory(args, mode, res):
    """Peak RSS growth (from before disk_offload), locked and swapio-pinned memory of each step, against the
    pinned budget memory_report() states and the RAM row `swapio plan` gives for the same options."""
    from swapio.tools import memplan
    report = res["memory"]
    itemsize = 2  # the benchmark's models are bf16
    plan_ram = memplan.offloaded_training_ram(res["weight_bytes"], report["state_bytes"], args.buffer_mib << 20,
                                              args.ring_mib << 20, res["largest_module"], itemsize,
                                              in_backward=mode == "in_backward")
    MiB = 1 << 20
    print(f"{mode}: pinned budget {report['pinned_budget'] / MiB:.0f} MiB ("
          + ", ".join(f"{k} {v['budget'] / MiB:.0f}" for k, v in report["pinned_parts"].items() if v["budget"])
          + f"); swapio plan's RAM row {plan_ram / MiB:.0f} MiB (largest module {res['largest_module'] / MiB:.1f} "
          "MiB)")
    for i, s in enumerate(res["steps"]):
        print(f"  step {i + 1}: peak RSS +{s['rss_growth'] / MiB:.0f} MiB ({s['rss_growth'] / plan_ram:.2f} x plan), "
              f"pinned peak {s['pinned_peak'] / MiB:.0f} MiB ({s['pinned_peak'] / report['pinned_budget']:.2f} x "
              f"budget), locked (VmLck) {s['locked'] / MiB:.0f} MiB")


def child_bandwidth(args):
    import torch
    from swapio import AioHandle
    from swapio.core.pinned import empty_pinned
    path = os.path.join(args.dir, "bw.bin")
    chunk = 256 << 20
    buf = empty_pinned(chunk, torch.uint8)
    buf.random_(0, 255)
    total = args.bw_gib * GiB
    h = AioHandle(**CONFIGS[0])
    try:  # the file's blocks exist before any timed write: training overwrites its files in place
        for f in [h.pwrite(buf, path, off) for off in range(0, total, chunk)]:
            f.wait()
    finally:
        h.close()
    out = []
    for cfg in CONFIGS:
        h = AioHandle(**cfg)
        try:
            t0 = time.perf_counter()
            futures = [h.pwrite(buf, path, off) for off in range(0, total, chunk)]
            for f in futures:
                f.wait()
            os.sync()
            write = total / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            for off in range(0, total, chunk):
                h.pread(buf, path, off).wait()
            read = total / (time.perf_counter() - t0) / 1e9
        finally:
            h.close()
        out.append(dict(cfg, read_GBps=read, write_GBps=write))
    os.remove(path)
    return out


def child_compute(args):
    """Seconds of forward + backward of one layer, of the embedding + head, and of Adam for one parameter."""
    import torch
    import transformers
    from param_offload import _config
    from swapio.optim import OffloadAdamW
    cfg = _config(args)
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(cfg, layer_idx=0).to(torch.bfloat16)
    x = torch.randn(1, args.tokens, args.width, dtype=torch.bfloat16, requires_grad=True)
    wte = torch.nn.Embedding(args.vocab, args.width).to(torch.bfloat16)
    ids = torch.randint(0, args.vocab, (1, args.tokens))

    def layer():
        block(x)[0].float().sum().backward()

    def head():
        h = wte(ids)
        logits = torch.nn.functional.linear(h, wte.weight)
        torch.nn.functional.cross_entropy(logits.float().view(-1, args.vocab), ids.view(-1)).backward()

    def timed(fn, n=3):
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    n = 64 << 20
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p.grad = torch.randn(n).bfloat16()
    opt = OffloadAdamW([p], lr=1e-5)
    adam = timed(opt.step) / n
    opt.close()
    return dict(layer_s=timed(layer), head_s=timed(head), adam_s_per_param=adam)


def run_child(args, name):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--dir", args.dir, "--layers",
           str(args.layers), "--width", str(args.width), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
           "--steps", str(args.steps), "--bw-gib", str(args.bw_gib), "--ring-mib", str(args.ring_mib),
           "--buffer-mib", str(args.buffer_mib), "--arch", args.arch]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"{name} failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_deepspeed(args):
    """(per-step results, None) of DeepSpeed ZeRO-3 NVMe offload on the same shapes, or (None, why not)."""
    python = args.deepspeed_python or sys.executable
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, text=True)
    if probe.returncode:
        return None, f"import deepspeed failed in {python}: {probe.stderr.strip().splitlines()[-1][:200]}"
    nvme = os.path.join(args.dir, "deepspeed-nvme")
    shutil.rmtree(nvme, ignore_errors=True)
    cmd = [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deepspeed_zero3.py"), nvme,
           str(args.layers), str(args.width), str(args.vocab), str(args.tokens), str(args.steps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.deepspeed_timeout)
    except subprocess.TimeoutExpired as exc:
        steps = [json.loads(x) for x in (exc.stdout or b"").decode().splitlines() if x.startswith("{")]
        return steps or None, f"timed out after {args.deepspeed_timeout} s ({len(steps)} steps done)"
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    steps = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode == -9:
        return steps or None, ("killed by SIGKILL (the kernel's OOM killer: dmesg says) after "
                               f"{len(steps)} step(s)")
    if out.returncode:
        last = [x for x in out.stderr.strip().splitlines() if x.strip()][-1:] or ["?"]
        return steps or None, f"failed (exit {out.returncode}): {last[0][:300]}"
    return steps, None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/offload/train")
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--width", type=int, default=2560)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bw-gib", type=int, default=4)
    ap.add_argument("--ring-mib", type=int, default=512)
    ap.add_argument("--buffer-mib", type=int, default=512)
    ap.add_argument("--modes", default="accumulate,in_backward")
    ap.add_argument("--arch", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--memory", action="store_true",
                    help="only the training runs and their host memory against the stated budget (no bandwidth, "
                         "compute or DeepSpeed runs)")
    ap.add_argument("--deepspeed-python", default=None,
                    help="a Python with deepspeed (and libaio-dev) for the ZeRO-3 NVMe peer (default: this one)")
    ap.add_argument("--deepspeed-timeout", type=int, default=1800)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--child", default=None)
    args = ap.parse_args(argv)
    if args.child:
        fn = {"bandwidth": child_bandwidth, "compute": child_compute}.get(args.child, child_train)
        print(json.dumps(fn(args)))
        return
    import torch
    os.makedirs(args.dir, exist_ok=True)
    ckpt = os.path.join(args.dir, "model.safetensors")
    model = _meta_model(args)
    n = sum(p.numel() for p in model.parameters())
    del model
    need = n * (2 + 4 + 12)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"model: {'Llama' if args.arch == 'llama' else 'GPT-2'} {args.layers} layers x {args.width}: {n / 1e9:.2f} G parameters; weights + fp32 grads + "
          f"Adam state {need / 1e9:.1f} GB = {need / ram:.2f} x RAM ({ram / 1e9:.1f} GB)")
    if not os.path.exists(ckpt):
        t0 = time.perf_counter()
        write_checkpoint(args, ckpt)
        os.sync()  # its dirty pages must not be flushed during the bandwidth measurement
        print(f"wrote {ckpt} in {time.perf_counter() - t0:.0f} s")
    if args.memory:
        for mode in [m for m in args.modes.split(",") if m]:
            print_memory(args, mode, run_child(args, mode))
        return
    from swapio.kernels import ops
    print(f"Adam kernel level: {ops.cpu_capability()}; "
          f"torch threads {torch.get_num_threads()}")
    bw = run_child(args, "bandwidth")
    read_bw, write_bw = max(c["read_GBps"] for c in bw), max(c["write_GBps"] for c in bw)
    print("handle bandwidth: " + "; ".join(f"bs {c['block_size'] >> 20} MiB qd {c['queue_depth']} thr "
                                           f"{c['threads']}: read {c['read_GBps']:.2f} write {c['write_GBps']:.2f} "
                                           "GB/s" for c in bw))
    comp = run_child(args, "compute")
    compute_s = comp["layer_s"] * args.layers + comp["head_s"] + comp["adam_s_per_param"] * n
    print(f"compute only: layer {comp['layer_s']:.3f} s x {args.layers} + head {comp['head_s']:.3f} s + Adam "
          f"{comp['adam_s_per_param'] * n:.2f} s = {compute_s:.2f} s")
    results, rows = {}, []
    for mode in [m for m in args.modes.split(",") if m]:
        res = run_child(args, mode)
        results[mode] = res
        for i, s in enumerate(res["steps"]):
            io_s = s["read"] / 1e9 / read_bw + s["written"] / 1e9 / write_bw
            bound = max(io_s, compute_s)
            s["bound_s"], s["ratio"] = bound, s["total_s"] / bound
            rows.append((mode, i + 1, f"{s['forward_s']:.1f}", f"{s['backward_s']:.1f}", f"{s['step_s']:.1f}",
                         f"{s['total_s']:.1f}", f"{s['read'] / 1e9:.1f}", f"{s['written'] / 1e9:.1f}",
                         f"{s['peak_rss'] / GiB:.2f}", f"{io_s:.1f}", f"{bound:.1f}", f"{s['ratio']:.2f}"))
        print(f"{mode}: setup {res['setup_s']:.0f} s; memory_report {res['memory']}")
        print_memory(args, mode, res)
    ds_steps, why = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else run_deepspeed(args)
    for i, s in enumerate(ds_steps or []):
        io_s = s["read"] / 1e9 / read_bw + s["written"] / 1e9 / write_bw
        bound = max(io_s, compute_s)
        s["ratio"] = s["total_s"] / bound
        rows.append(("deepspeed", i + 1, f"{s['forward_s']:.1f}", f"{s['backward_s']:.1f}", f"{s['step_s']:.1f}",
                     f"{s['total_s']:.1f}", f"{s['read'] / 1e9:.1f}", f"{s['written'] / 1e9:.1f}",
                     f"{s['peak_rss'] / GiB:.2f}", f"{io_s:.1f}", f"{bound:.1f}", f"{s['ratio']:.2f}"))
    print_table(("mode", "step", "fwd s", "bwd s", "step s", "total s", "read GB", "written GB", "peak RSS GiB",
                 "I/O s", "bound s", "x bound"), rows)
    med = {m: statistics.median(s["total_s"] for s in r["steps"][1:]) if len(r["steps"]) > 1 else float("nan")
           for m, r in results.items()}
    if "accumulate" in med:
        ratio = statistics.median(s["ratio"] for s in results["accumulate"]["steps"][1:])
        print(f"accumulate: median step {med['accumulate']:.1f} s = {ratio:.2f} x bound (goal <= 1.25)")
    if "in_backward" in med:
        ratio = statistics.median(s["ratio"] for s in results["in_backward"]["steps"][1:])
        line = f"in_backward: median step {med['in_backward']:.1f} s = {ratio:.2f} x its bound"
        if "accumulate" in med:
            line += f", {med['in_backward'] / med['accumulate']:.2f} x accumulate (goal <= 0.75)"
        print(line)
    if ds_steps and len(ds_steps) > 1:
        ds = statistics.median(s["total_s"] for s in ds_steps[1:])
        print(f"DeepSpeed ZeRO-3 offload_param + offload_optimizer (nvme): median step {ds:.1f} s; "
              + ", ".join(f"{m} is {ds / t:.2f}x faster" for m, t in med.items()) + (f" ({why})" if why else ""))
    else:
        print(f"DeepSpeed ZeRO-3 offload_param + offload_optimizer (nvme): {why or 'no step timed'}")


if __name__ == "__main__":
    main()
