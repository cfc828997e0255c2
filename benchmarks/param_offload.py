"""Parameter offload from disk: swapio.offload.disk_offload(checkpoint=...) against accelerate.disk_offload, the
disk's own read time and the resident model; and loading a checkpoint into memory against safetensors.

    python benchmarks/param_offload.py [--dir /tmp/offload/bench] [--layers 24 --width 2048] [--repeats 3]
                                       [--arch gpt2|llama]

The model is a GPT-2 built from a transformers config (random weights, bf16; 24 layers x 2048 wide: 1.31 G
parameters, 2.6 GB), or with --arch llama a Llama of the same layers and width (RMSNorm, RoPE, SwiGLU MLP 8/3 as
wide, untied head; its norms are registered after attention and MLP but run before them, which is what a first
forward's read-ahead must cope with), written once as a safetensors checkpoint (streamed, tensor by tensor) and once as
accelerate's offload folder. Every measurement runs in a fresh process, with the page cache dropped right before
the timed part (root only; without root the figures are cache-warm and the script says so), in an order that
rotates from one round to the next. Per round:
  swapio       disk_offload(meta model, checkpoint=...): the first forward (batch 1 x --tokens), cold; also the
               bytes it read over the bytes its modules need (1.0: every byte read once; reads already started
               for the next forward not counted)
  accelerate   accelerate.disk_offload(meta model, offload folder): the same forward, cold
  resident     the model in RAM: the same forward (compute only)
  read         the checkpoint read whole by swapio into pinned buffers, once per handle configuration (their
               order rotating too); the best configuration is the one with the highest median bandwidth over
               the rounds, and its median gives the I/O bound: weight bytes / that bandwidth. (The highest read
               of each round, whichever configuration made it, is printed too: on a disk whose identical reads
               vary by +-15 %, that maximum of a few noisy samples runs above what any one configuration
               delivers, and is no configuration's bandwidth.)
  load-st      safetensors.torch.load_file(checkpoint), cold (its default mmap backend)
  load-st-pread  the same with backend="pread"
  load-swapio  swapio.offload.load_file(checkpoint), cold
               every load is followed by touching one byte per page of every tensor it returned: an mmap-backed
               tensor is only read from disk when touched, and "in memory" means readable without I/O
Each process first runs matmuls of the model's shapes on small random tensors, so one-time kernel setup is not
timed. Peak RSS growth is each process's peak RSS (VmHWM) from before its setup (offload hooks and ring, or the
resident weights) to the end of the timed part.
Goals: swapio <= 1.15 x max(I/O bound, resident) and accelerate / swapio >= 1.5.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

from _common import REPO, drop_caches, print_table, proc_status, reset_peak_rss  # first: the checkout's swapio

HERE = os.path.dirname(os.path.abspath(__file__))

GiB, MiB = 1 << 30, 1 << 20
READ_CONFIGS = [dict(block_size=1 << 20, queue_depth=32, threads=1), dict(block_size=4 << 20, queue_depth=16, threads=1),
                dict(block_size=1 << 20, queue_depth=32, threads=2)]


# ---- child side -------------------------------------------------------------------------------------------
def _llama_ffn(width):
    return (8 * width // 3 + 255) // 256 * 256


def _config(args):
    import transformers
    transformers.logging.set_verbosity_error()
    if getattr(args, "arch", "gpt2") == "llama":
        return transformers.LlamaConfig(hidden_size=args.width, intermediate_size=_llama_ffn(args.width),
                                        num_hidden_layers=args.layers, num_attention_heads=args.width // 128,
                                        num_key_value_heads=args.width // 128, vocab_size=args.vocab,
                                        max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 128,
                                   vocab_size=args.vocab, n_positions=1024, bos_token_id=0, eos_token_id=0)


def _meta_model(args):
    import torch
    import transformers
    if getattr(args, "arch", "gpt2") == "llama":
        import accelerate
        with accelerate.init_empty_weights():  # weights on meta, buffers (RoPE's inv_freq) computed for real
            return transformers.LlamaForCausalLM(_config(args)).to(torch.bfloat16).eval()
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(_config(args)).to(torch.bfloat16).eval()


def _warm_kernels(args):
    """The model's matmul shapes once on small random tensors: kernel setup is not part of what is timed."""
    import torch
    w, x = args.width, torch.randn(args.tokens, args.width).bfloat16()
    with torch.no_grad():
        for n in (3 * w, w, 4 * w):
            torch.addmm(torch.zeros(n).bfloat16(), x, torch.randn(w, n).bfloat16())
        torch.addmm(torch.zeros(w).bfloat16(), torch.randn(args.tokens, 4 * w).bfloat16(), torch.randn(4 * w, w).bfloat16())
        if args.arch == "llama":  # its MLP's shapes
            f = _llama_ffn(w)
            torch.nn.functional.linear(x, torch.randn(f, w).bfloat16())
            torch.nn.functional.linear(torch.randn(args.tokens, f).bfloat16(), torch.randn(w, f).bfloat16())
        torch.nn.functional.linear(x, torch.randn(4096, w).bfloat16())


def _forward(model, args):
    import torch
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def _touch(tensors):
    """Reads one byte of every 4 KiB page of every tensor (what makes an mmap-backed load actually load)."""
    import torch
    total = 0
    for t in tensors.values():
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def _timed(fn, cold):
    """Seconds fn() takes, after dropping the page cache if `cold`."""
    if cold:
        drop_caches()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _rss_base():
    """RSS now, with the peak reset to it: peak growth from here covers the setup and the timed part."""
    base = proc_status("VmRSS")
    reset_peak_rss()
    return base


def child(args):
    import torch
    torch.set_num_threads(args.cpu_threads or torch.get_num_threads())
    ckpt = os.path.join(args.dir, "model.safetensors")
    out = {}
    if args.child in ("swapio", "accelerate", "resident"):
        _warm_kernels(args)
        model = _meta_model(args)
        base = _rss_base()
        if args.child == "swapio":
            import swapio
            from swapio.offload import disk_offload
            handle = swapio.AioHandle(**json.loads(args.handle)) if args.handle else None
            disk_offload(model, checkpoint=ckpt, buffer_bytes=args.buffer_mib * MiB, prefetch=args.prefetch,
                         handle=handle)
        elif args.child == "accelerate":
            import accelerate
            accelerate.disk_offload(model, os.path.join(args.dir, "accelerate"), execution_device="cpu")
        else:
            from swapio.offload import load_file
            model.load_state_dict(load_file(ckpt), strict=False, assign=True)
            model.tie_weights()
        out["seconds"] = _timed(lambda: _forward(model, args), cold=args.child != "resident")
        out["rss"] = proc_status("VmHWM") - base
        if args.child == "swapio":  # what this forward read over what it needs: the records' spans (4 KiB-rounded),
            from swapio.offload import stats   # not counting the reads already started for the next forward
            from swapio.offload.api import _offloaded
            engine = _offloaded[model]
            spans = lambda records: sum(length for r in records for _, _, length, _ in r.spans)  # noqa: E731
            ahead = [r for r, f in engine.fetcher.fetches.items()  # a tied record kept in the spare was used now
                     if not (f.alloc[0] == "spare" and len(r.units) > 1)]
            out["read_ratio"] = (stats(model)["bytes_read"] - spans(ahead)) / spans(engine.records)
    elif args.child == "read":
        import torch
        import swapio
        size = os.path.getsize(ckpt)
        piece = 64 * MiB
        bufs = [swapio.empty_pinned(piece, torch.uint8) for _ in range(4)]
        out["configs"] = []
        shift = args.round % len(READ_CONFIGS)
        for cfg in READ_CONFIGS[shift:] + READ_CONFIGS[:shift]:
            with swapio.AioHandle(**cfg) as h:
                def read_all():
                    pending = []
                    for k, off in enumerate(range(0, size, piece)):
                        if len(pending) == len(bufs):
                            pending.pop(0).wait()
                        n = min(piece, size - off)
                        pending.append(h.pread(bufs[k % len(bufs)][:n], ckpt, off))
                    for f in pending:
                        f.wait()
                seconds = _timed(read_all, cold=True)
            out["configs"].append(dict(cfg, GBps=size / seconds / 1e9))
    elif args.child.startswith("load-"):
        import safetensors.torch
        from swapio.offload import load_file
        load = {"load-st": lambda: safetensors.torch.load_file(ckpt),
                "load-st-pread": lambda: safetensors.torch.load_file(ckpt, backend="pread"),
                "load-swapio": lambda: load_file(ckpt)}[args.child]
        base = _rss_base()
        out["seconds"] = _timed(lambda: _touch(load()), cold=True)
        out["rss"] = proc_status("VmHWM") - base
    print(json.dumps(out))


# ---- parent side ------------------------------------------------------------------------------------------
def write_checkpoint(args, path):
    """The model's tensors (GPT-2's tied lm_head left out, as save_pretrained does), GPT-2's init: norms 1/0,
    others N(0, 0.02), written one tensor at a time so the full state dict never exists."""
    import torch
    model = _meta_model(args)
    tied = "lm_head.weight" if args.arch == "gpt2" else None
    names = [(k, tuple(v.shape)) for k, v in model.state_dict().items() if k != tied]
    header, offset = {}, 0
    for k, shape in names:
        n = math.prod(shape) * 2
        header[k] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(0)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for k, shape in names:
            if ".ln_" in k or k.startswith("transformer.ln_f") or k.endswith("norm.weight"):
                t = torch.ones(shape) if k.endswith("weight") else torch.zeros(shape)
            else:
                t = torch.empty(shape).normal_(0, 0.02, generator=g)
            f.write(t.bfloat16().view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)
    return offset


def run_child(args, name, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--round", str(args.round),
           "--dir", args.dir, "--layers", str(args.layers), "--arch", args.arch,
           "--width", str(args.width), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
           "--buffer-mib", str(args.buffer_mib), "--prefetch", str(args.prefetch),
           "--cpu-threads", str(args.cpu_threads or 0), *extra]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/offload/bench", help="scratch directory (about 2 x the model)")
    ap.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2",
                    help="the model: GPT-2 (default) or a Llama of the same layers and width")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--tokens", type=int, default=1,
                    help="input length of the timed forward, batch 1 (default 1: a decode step, the I/O-bound case)")
    ap.add_argument("--buffer-mib", type=int, default=256, help="disk_offload's buffer_bytes, in MiB")
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch threads in every child (default 1: on a shared 2-core machine a second compute "
                         "thread slows the forward several times over and starves the I/O worker; 0: torch's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and offload folder afterwards")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--handle", default="", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.cpu_threads = args.cpu_threads or None
        return child(args)

    os.makedirs(args.dir, exist_ok=True)
    ckpt = os.path.join(args.dir, "model.safetensors")
    try:
        t = time.perf_counter()
        if not os.path.exists(ckpt):
            write_checkpoint(args, ckpt)
        weight_bytes = os.path.getsize(ckpt)
        acc_dir = os.path.join(args.dir, "accelerate")
        if not os.path.isfile(os.path.join(acc_dir, "index.json")):
            code = (f"import sys; sys.path[:0] = [{REPO!r}, {HERE!r}]\n"
                    "import argparse, accelerate\nfrom param_offload import _meta_model\n"
                    "from swapio.offload import load_file\n"
                    f"a = argparse.Namespace(layers={args.layers}, width={args.width}, vocab={args.vocab}, "
                    f"arch={args.arch!r})\n"
                    "m = _meta_model(a)\n"
                    f"m.load_state_dict(load_file({ckpt!r}), strict=False, assign=True); m.tie_weights()\n"
                    f"accelerate.utils.offload_state_dict({acc_dir!r}, m.state_dict())\n")
            subprocess.run([sys.executable, "-c", code], check=True, timeout=1800)
        cold = drop_caches()
        print(f"setup {time.perf_counter() - t:.0f} s; checkpoint {weight_bytes / 1e9:.2f} GB; page cache "
              f"{'dropped before each timed run' if cold else 'NOT dropped (needs root): figures are cache-warm'}")

        names = ["swapio", "accelerate", "resident", "read", "load-st", "load-st-pread", "load-swapio"]
        runs = {n: [] for n in names}
        for r in range(args.repeats):
            args.round = r
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                res = run_child(args, n)
                runs[n].append(res)
                brief = f"{res['seconds']:.2f} s" if "seconds" in res else \
                    " ".join(f"{c['GBps']:.2f}" for c in res["configs"]) + " GB/s"
                print(f"  round {r + 1} {n:12s} {brief}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    med = {n: statistics.median(x["seconds"] for x in runs[n]) for n in names if n != "read"}
    rss = {n: statistics.median(x["rss"] for x in runs[n]) for n in names if n != "read"}
    key = lambda c: json.dumps({k: c[k] for k in READ_CONFIGS[0]}, sort_keys=True)  # noqa: E731
    by_config = {key(c): [] for c in READ_CONFIGS}
    for res in runs["read"]:
        for c in res["configs"]:
            by_config[key(c)].append(c["GBps"])
    best_config = max(by_config, key=lambda k: statistics.median(by_config[k]))
    bw = statistics.median(by_config[best_config])
    luckiest = statistics.median(max(c["GBps"] for c in res["configs"]) for res in runs["read"])
    io_bound = weight_bytes / 1e9 / bw
    bound = max(io_bound, med["resident"])
    per_round = [s["seconds"] / max(weight_bytes / 1e9 / b, res["seconds"])
                 for s, b, res in zip(runs["swapio"], by_config[best_config], runs["resident"])]
    result = {"weight_bytes": weight_bytes, "cold": cold, "median_s": med, "peak_rss_growth": rss,
              "best_config": json.loads(best_config), "best_read_GBps": bw, "read_GBps_by_config": by_config,
              "luckiest_read_GBps": luckiest, "read_configs": runs["read"], "io_bound_s": io_bound,
              "swapio_vs_bound": med["swapio"] / bound, "swapio_vs_bound_per_round": per_round,
              "swapio_vs_luckiest_bound": med["swapio"] / max(weight_bytes / 1e9 / luckiest, med["resident"]),
              "accelerate_over_swapio": med["accelerate"] / med["swapio"],
              "load_st_over_swapio": med["load-st"] / med["load-swapio"], "runs": runs}
    if args.json:
        print(json.dumps(result))
        return 0
    name = {"gpt2": "GPT-2", "llama": "Llama"}[args.arch]
    print(f"\n{name} {args.layers} x {args.width}, bf16, {weight_bytes / 1e9:.2f} GB; forward of 1 x {args.tokens} "
          f"tokens; medians of {args.repeats} interleaved rounds")
    rows = [(n, f"{med[n]:.2f}", f"{rss[n] / MiB:.0f}") for n in ("swapio", "accelerate", "resident", "load-st",
                                                                 "load-st-pread", "load-swapio")]
    print_table(["run", "seconds", "peak RSS growth MiB"], rows)
    for k, v in by_config.items():
        print(f"read {k}: {' '.join(f'{x:.2f}' for x in v)} GB/s, median {statistics.median(v):.2f}"
              f"{'  <- best' if k == best_config else ''}")
    print(f"swapio's first forward read {statistics.median(x['read_ratio'] for x in runs['swapio']):.2f} x the "
          "weights it needs (1.00: each byte once)")
    print(f"swapio best configuration {bw:.2f} GB/s -> I/O bound {io_bound:.2f} s")
    print(f"swapio / max(I/O bound, resident) = {result['swapio_vs_bound']:.2f} (per round, against that round's "
          f"read with the best configuration: {' '.join(f'{x:.2f}' for x in per_round)}; goal <= 1.15)")
    print(f"  against each round's highest read, any configuration ({luckiest:.2f} GB/s in median): "
          f"{result['swapio_vs_luckiest_bound']:.2f}")
    print(f"accelerate / swapio = {result['accelerate_over_swapio']:.2f} (goal >= 1.5)")
    print(f"load: safetensors.load_file / swapio.offload.load_file = {result['load_st_over_swapio']:.2f} (mmap), "
          f"{med['load-st-pread'] / med['load-swapio']:.2f} (pread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
