"""CPU Adam step throughput: swapio's kernel against torch, DeepSpeed and the memory-bandwidth bound.

For each size and thread count, every method steps the same flat fp32 buffers (param, grad, exp_avg,
exp_avg_sq), and the methods take turns (A B C A B C ...) so that drift on a noisy machine hits all alike;
the table shows medians in parameters per second and ratios.

fp32 step (28 bytes per parameter: reads p, g, m, v; writes p, m, v):
  swapio        swapio.ops.adam_step_
  torch-fused   torch.optim.AdamW(fused=True)
  torch-loop    torch.optim.AdamW(foreach=False) (the default for-loop on CPU)
  deepspeed     deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode=True), when importable
  bound         a STREAM-style triad a = b + s*c timed with torch in the same run: its bandwidth
                (counted as STREAM does, 12 bytes per element, without the write-allocate read of `a`)
                divided by 28 bytes per parameter. An in-place update has no write-allocate traffic, so a
                kernel at the memory limit can show up to ~133% of this bound.
mixed step (bf16 grads in, fp32 master and moments, bf16 params out; also 28 bytes per parameter):
  swapio        adam_step_(p32, g_bf16, m, v, param_out=p_bf16), one pass
  torch-best    g32.copy_(g_bf16); AdamW(fused=True).step(); p_bf16.copy_(p32)
smaller state (fp32 grads; each against the same triad bound divided by its own bytes per parameter):
  adam-bf16     bf16 moments, stochastic rounding    20 B: p r+w, g, m r+w 2+2, v r+w 2+2
  adam-int8     int8 block-wise moments              16.06 B: p r+w, g, m 1+1, v 1+1, scales
  lion-fp32     Lion, fp32 moment                    20 B: p r+w, g, m r+w
  lion-int8     Lion, int8 block-wise moment         14.03 B: p r+w, g, m 1+1, scale
  int8 / fp32   the time of an int8-state step over that of the fp32-state step of the same optimizer (swapio's fp32
                Adam, timed again in these rounds; lion-fp32), same level: below 1, int8 state is the faster
  These steps take one of four gradients in turn, as training brings a new one each step: with one fixed gradient
  the int8 moments settle where their codes repeat, and the encoder's rare exact path (csrc/adam/quant.h) hardly
  ever runs.

Usage: python benchmarks/adam_kernel.py [--sizes 32M,128M] [--threads 1,2] [--repeats 5]
"""
import argparse

import torch

import _common  # first: the checkout's swapio
import swapio.ops as sops
from swapio.tools import fmt_size, parse_size

BYTES_PER_PARAM = 28
STATE_BYTES = {"adam-bf16": 20, "adam-int8": 16 + 16 / 256, "lion-fp32": 20, "lion-int8": 14 + 8 / 256}
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def make_opt(cls, p, g, m, v, **kw):
    """A torch-style optimizer over one Parameter viewing p, whose state tensors are m and v (shared)."""
    param = torch.nn.Parameter(p, requires_grad=True)  # shares p's storage
    param.grad = g
    opt = cls([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], **kw)
    opt.step()  # creates the state; then point it at the shared buffers
    st = opt.state[param]
    st["exp_avg"] = m
    st["exp_avg_sq"] = v
    return opt


def run_bench(n, threads, repeats, with_deepspeed):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).mul_(1e-2)
    m = torch.zeros(n)
    v = torch.zeros(n)
    g16 = g.to(torch.bfloat16)
    p16 = torch.empty(n, dtype=torch.bfloat16)
    ta, tb, tc = torch.empty(n), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    step = [0]

    def swapio_fp32():
        step[0] += 1
        sops.adam_step_(p, g, m, v, step=step[0], threads=threads, **HYPER)

    def swapio_mixed():
        step[0] += 1
        sops.adam_step_(p, g16, m, v, step=step[0], param_out=p16, threads=threads, **HYPER)

    fused = make_opt(torch.optim.AdamW, p, g, m, v, fused=True)
    loop = make_opt(torch.optim.AdamW, p, g, m, v, foreach=False, fused=False)

    def torch_mixed():
        g.copy_(g16)
        fused.step()
        p16.copy_(p)

    def triad():
        torch.add(tb, tc, alpha=3.0, out=ta)

    fp32 = {"swapio": swapio_fp32, "torch-fused": fused.step, "torch-loop": loop.step, "triad": triad}
    if with_deepspeed:
        ds = make_deepspeed(p, g, m, v)
        if ds is not None:
            fp32["deepspeed"] = ds.step
    mixed = {"swapio": swapio_mixed, "torch-best": torch_mixed}

    def timeit(fns):
        return _common.interleaved_medians(fns, repeats)

    t32 = timeit(fp32)
    tmx = timeit(mixed)
    del fused, loop
    tst = timeit(state_steps(p, g, n, threads, triad))
    return t32, tmx, tst


GRADIENTS = 4  # the smaller-state steps' gradients, taken in turn


def state_steps(p, g, n, threads, triad):
    """The smaller-state kernels over the same p, with g and GRADIENTS - 1 more gradients taken in turn, plus the
    triad and swapio's fp32 Adam (timed again, interleaved with them, on the same gradients)."""
    from swapio import quant
    gen = torch.Generator().manual_seed(1)
    grads = [g] + [torch.randn(n, generator=gen).mul_(1e-2) for _ in range(GRADIENTS - 1)]
    bf = {k: torch.zeros(n, dtype=torch.bfloat16) for k in ("m", "v")}
    i8 = {}
    for name, signed in (("m", True), ("v", False)):
        i8[name], i8[name + "_scale"] = quant.quantize(torch.zeros(n), signed)
    lm = torch.zeros(n)
    lq, lq_scale = quant.quantize(torch.zeros(n), True)
    step = [0]

    m32, v32 = torch.zeros(n), torch.zeros(n)
    calls = {}

    def grad(kind):  # each kernel's next gradient
        calls[kind] = calls.get(kind, 0) + 1
        return grads[calls[kind] % GRADIENTS]

    def tick():
        step[0] += 1
        return step[0]

    return {
        "adam-bf16": lambda: sops.adam_step_(p, grad("adam-bf16"), bf["m"], bf["v"], step=tick(), threads=threads,
                                             **HYPER),
        "adam-int8": lambda: sops.adam_step_(p, grad("adam-int8"), i8["m"], i8["v"], step=tick(), threads=threads,
                                             exp_avg_scale=i8["m_scale"], exp_avg_sq_scale=i8["v_scale"], **HYPER),
        "lion-fp32": lambda: sops.lion_step_(p, grad("lion-fp32"), lm, lr=1e-4, weight_decay=0.1, threads=threads),
        "lion-int8": lambda: sops.lion_step_(p, grad("lion-int8"), lq, exp_avg_scale=lq_scale, lr=1e-4,
                                             weight_decay=0.1, threads=threads),
        "triad": triad,
        "adam-fp32": lambda: sops.adam_step_(p, grad("adam-fp32"), m32, v32, step=tick(), threads=threads, **HYPER),
    }


def make_deepspeed(p, g, m, v):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - not installed, or its JIT build failed
        return None
    param = torch.nn.Parameter(p, requires_grad=True)
    param.grad = g
    opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                           weight_decay=HYPER["weight_decay"], adamw_mode=True)
    opt.step()
    opt.state[param]["exp_avg"] = m
    opt.state[param]["exp_avg_sq"] = v
    return opt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32M,128M", help="parameter counts, comma-separated (K/M/G = 2^10/20/30)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per method (interleaved)")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if importable")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]

    _common.kernel_banner(args.repeats)
    hdr = (f"{'size':>5} {'thr':>3} | {'swapio':>7} {'fused':>7} {'loop':>7} {'dspeed':>7} {'bound':>7} | "
           f"{'x fused':>7} {'x loop':>7} {'%bound':>6} || {'mix sw':>7} {'mix tch':>7} {'x mix':>6}")
    print(hdr)
    print("-" * len(hdr))
    state_rows = []
    for n in sizes:
        for t in threads:
            t32, tmx, tst = run_bench(n, t, args.repeats, not args.no_deepspeed)
            state_rows.append((n, t, tst))
            rate = {k: n / s / 1e9 for k, s in t32.items()}
            bound = (12 * n / t32["triad"]) / BYTES_PER_PARAM / 1e9
            ds = f"{rate['deepspeed']:7.2f}" if "deepspeed" in rate else f"{'-':>7}"
            mix_sw, mix_t = n / tmx["swapio"] / 1e9, n / tmx["torch-best"] / 1e9
            print(f"{fmt_size(n):>5} {t:>3} | {rate['swapio']:7.2f} {rate['torch-fused']:7.2f} {rate['torch-loop']:7.2f} "
                  f"{ds} {bound:7.2f} | {rate['swapio'] / rate['torch-fused']:7.2f} "
                  f"{rate['swapio'] / rate['torch-loop']:7.2f} {100 * rate['swapio'] / bound:5.0f}% || "
                  f"{mix_sw:7.2f} {mix_t:7.2f} {mix_sw / mix_t:6.2f}", flush=True)
    print("columns: Gparam/s of the fp32 step; x = swapio's ratio; bound = triad bandwidth / 28 B per param; "
          "mix = bf16 grads in, bf16 params out")
    print()
    names = list(STATE_BYTES)
    print("smaller state: Gparam/s, and in brackets the fraction of each kernel's own bound "
          "(triad bandwidth / its bytes per param)")
    hdr = (f"{'size':>5} {'thr':>3} | " + " ".join(f"{k:>16}" for k in names) + f" | {'triad GB/s':>10} | "
           f"{'int8/fp32 adam':>14} {'lion':>5}")
    print(hdr)
    print("-" * len(hdr))
    for n, t, tst in state_rows:
        bw = 12 * n / tst["triad"]
        cells = " ".join(f"{n / tst[k] / 1e9:7.2f} ({n / tst[k] * STATE_BYTES[k] / bw:5.2f})" for k in names)
        print(f"{fmt_size(n):>5} {t:>3} | {cells} | {bw / 1e9:10.1f} | {tst['adam-int8'] / tst['adam-fp32']:14.2f} "
              f"{tst['lion-int8'] / tst['lion-fp32']:5.2f}")


if __name__ == "__main__":
    main()
