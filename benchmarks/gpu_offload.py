"""The GPU path, as ratios measured in one run: a model on one GPU with its optimizer state in CPU RAM or on NVMe,
weights streamed to the GPU, and offloaded weights trained on the GPU.

  python benchmarks/gpu_offload.py [--dir /nvme/scratch] [--layers 24 --width 4096 --tokens 2048] [--smoke]

Optimizer (a step = forward + backward + step() + zero_grad(), median of --repeats after a warm-up, the same
model and batches for each): torch.optim.AdamW(fused=True) resident on the GPU; torchao's CPUOffloadOptimizer
(skipped when torchao is not installed); OffloadAdamW(offload="cpu"), also with in_backward=True; and
offload="nvme" against its own I/O bound (the state's bytes read and written once through an AioHandle in the
same directory). Goals: cpu <= 0.95x torchao's step time, in_backward <= 0.8x torchao's and
<= 1.25x resident, nvme <= 1.1x its I/O bound, GPU memory no more than torchao's.
Weights: cpu_offload forward of a GPT-2-style bf16 model against accelerate's cpu_offload and the PCIe copy of
the same bytes. Training offloaded weights: disk_offload + OffloadAdamW step against the resident step.
--smoke: tiny sizes, runs on a CPU (checks the script, no figures worth reading).
"""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import _common  # noqa: F401  (first: the checkout's swapio)
import swapio
import swapio.optim as so

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, repeats, warm=1):
    for _ in range(warm):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def mlp(width, layers):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(DEV)


def optimizer_part(args, scratch):
    x = torch.randn(args.tokens, args.width, device=DEV)
    out = {"params_M": round(args.width * (args.width + 1) * args.layers / 1e6, 1)}

    def run(name, make_opt):
        model = mlp(args.width, args.layers)
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        opt = make_opt(model)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        med, times = timed(step, args.repeats)
        entry = {"step_s": round(med, 4), "all": [round(t, 4) for t in times]}
        if CUDA:
            entry["gpu_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        if hasattr(opt, "step_report"):
            last = opt.step_report()["last"]
            entry["report"] = {k: round(v, 4) for k, v in last.items() if isinstance(v, float)} if last else None
            entry["io_bytes_per_step"] = opt.memory_report().get("io_bytes_per_step")
        if hasattr(opt, "close"):
            opt.close()
        del opt, model
        if CUDA:
            torch.cuda.empty_cache()
        out[name] = entry
        print(name, json.dumps(entry), flush=True)

    run("resident_fused", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=CUDA or None))
    try:
        from torchao.optim import CPUOffloadOptimizer
        if CUDA:
            run("torchao", lambda m: CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4))
    except ImportError as exc:
        out["torchao"] = f"skipped: {exc}"
    run("swapio_cpu", lambda m: so.OffloadAdamW(m.parameters(), lr=1e-4, offload="cpu"))
    for n in args.threads:  # the kernel's threads against the default (every core of the affinity mask)
        run(f"swapio_cpu_{n}_threads", lambda m, n=n: so.OffloadAdamW(m.parameters(), lr=1e-4, offload="cpu",
                                                                       cpu_threads=n))
    run("swapio_cpu_in_backward", lambda m: so.OffloadAdamW(m.parameters(), lr=1e-4, offload="cpu",
                                                             in_backward=True))
    if not args.no_nvme:
        run("swapio_nvme", lambda m: so.OffloadAdamW(m.parameters(), lr=1e-4, offload="nvme", swap_dir=scratch))
        io = out["swapio_nvme"]["io_bytes_per_step"] // 2
        out["nvme_io_bound_s"] = round(io_bound(scratch, io), 4)
        out["nvme_vs_io_bound"] = round(out["swapio_nvme"]["step_s"] / out["nvme_io_bound_s"], 3)
    ref = out["resident_fused"]["step_s"]
    for name in ("swapio_cpu", "swapio_cpu_in_backward"):
        out[f"{name}_vs_resident"] = round(out[name]["step_s"] / ref, 3)
        if isinstance(out.get("torchao"), dict):
            out[f"{name}_vs_torchao"] = round(out[name]["step_s"] / out["torchao"]["step_s"], 3)
    return out


def io_bound(directory, nbytes):
    """Seconds to write and then read nbytes once, sequentially, through an AioHandle from pinned memory."""
    buf = swapio.empty_pinned(nbytes, torch.uint8)
    buf.fill_(1)
    path = os.path.join(directory, "io-bound.bin")
    with swapio.AioHandle(block_size=1 << 20, queue_depth=32) as h:
        h.pwrite(buf, path).wait()
        t0 = time.perf_counter()
        h.pwrite(buf, path).wait()
        h.pread(buf, path).wait()
        took = time.perf_counter() - t0
    os.unlink(path)
    return took


def gpt2(layers, width, dtype):
    import transformers
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=8192,
                                  n_positions=256)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval(), cfg


def weights_part(args, scratch):
    if not CUDA:
        return {"skipped": "no CUDA"}
    from swapio.offload import cpu_offload, remove_offload
    out = {}
    model, _ = gpt2(args.gpt_layers, args.gpt_width, torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["model_gb"] = round(nbytes / 1e9, 3)
    ids = torch.randint(0, 8192, (1, 128), device=DEV)
    host, dev = swapio.empty_pinned(nbytes, torch.uint8), torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    out["pcie_copy_s"] = round(timed(lambda: dev.copy_(host, non_blocking=True), args.repeats)[0], 4)
    del host, dev
    cpu_offload(model, execution_device=DEV)
    with torch.no_grad():
        out["swapio_cpu_offload_s"] = round(timed(lambda: model(ids), args.repeats)[0], 4)
    remove_offload(model)
    try:
        import accelerate
        model, _ = gpt2(args.gpt_layers, args.gpt_width, torch.bfloat16)
        accelerate.cpu_offload(model, execution_device=torch.device(DEV))
        with torch.no_grad():
            out["accelerate_cpu_offload_s"] = round(timed(lambda: model(ids), args.repeats)[0], 4)
        out["swapio_vs_accelerate"] = round(out["accelerate_cpu_offload_s"] / out["swapio_cpu_offload_s"], 2)
    except ImportError as exc:
        out["accelerate"] = f"skipped: {exc}"
    out["swapio_vs_pcie_copy"] = round(out["swapio_cpu_offload_s"] / out["pcie_copy_s"], 2)
    return out


def training_part(args, scratch):
    from swapio.offload import disk_offload
    out = {}
    ids = torch.randint(0, 8192, (2, 128), device=DEV)

    def run(name, offloaded):
        model, _ = gpt2(args.train_layers, args.train_width, torch.float32)
        model.train()
        if offloaded:
            disk_offload(model, offload_dir=tempfile.mkdtemp(dir=scratch), execution_device=DEV)
            opt = so.OffloadAdamW(model.parameters(), lr=1e-4, offload="cpu")
        else:
            model.to(DEV)
            opt = so.OffloadAdamW(model.parameters(), lr=1e-4, offload="cpu")

        def step():
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        out[name] = round(timed(step, args.repeats)[0], 4)
        opt.close()
    run("resident_weights_step_s", False)
    run("disk_offload_weights_step_s", True)
    out["offloaded_vs_resident"] = round(out["disk_offload_weights_step_s"] / out["resident_weights_step_s"], 2)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to test (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--gpt-layers", type=int, default=24)
    ap.add_argument("--gpt-width", type=int, default=2048)
    ap.add_argument("--train-layers", type=int, default=12)
    ap.add_argument("--train-width", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="optim,weights,train")
    ap.add_argument("--no-nvme", action="store_true")
    ap.add_argument("--threads", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="also run the cpu mode with these cpu_threads (comma-separated)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        (args.layers, args.width, args.tokens, args.gpt_layers, args.gpt_width, args.train_layers, args.train_width,
         args.repeats) = 2, 256, 64, 2, 128, 2, 128, 1
    scratch = tempfile.mkdtemp(dir=args.dir)
    print(f"device: {torch.cuda.get_device_name(0) if CUDA else 'cpu'}; torch {torch.__version__}; "
          f"CPU threads usable {len(os.sched_getaffinity(0))}; SIMD {swapio.ops.cpu_capability()}", flush=True)
    results = {}
    parts = {"optim": optimizer_part, "weights": weights_part, "train": training_part}
    for name in args.parts.split(","):
        results[name] = parts[name](args, scratch)
        print(f"== {name}: {json.dumps(results[name])}", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_offload.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
