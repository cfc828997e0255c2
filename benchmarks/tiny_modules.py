"""A model of many tiny modules under weight offload: swapio's per-module cost against accelerate's and resident.

    python benchmarks/tiny_modules.py [--modules 800] [--width 16] [--repeats 7] [--dir /tmp/tiny_modules]

The model is an nn.Sequential of --modules Linear(width, width) (fp32, 1 KiB each: none counts towards prefetch,
as norms and biases do not), offloaded four ways in one process, one torch thread, CPU execution:
  resident     the model as it is
  swapio-cpu   swapio.offload.cpu_offload(model)
  swapio-disk  swapio.offload.disk_offload(model, dir) (its default ring holds the whole model: page cache warm)
  accelerate   accelerate.cpu_offload(model, execution_device=cpu)
Each timed call is one forward of a batch of 4 under no_grad, after one warm-up forward each (swapio learns the
module order in its first forward); medians of --repeats interleaved rounds. The outputs are checked equal to the
resident model's. Prints seconds per forward, microseconds per module, and swapio / accelerate and swapio /
resident (lower is better).
"""
import argparse
import os
import shutil
import tempfile

import _common  # noqa: F401 (puts the checkout first on sys.path)
from _common import interleaved_medians


def build(n, width):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)]).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=800)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where disk_offload writes (default: a temporary directory)")
    args = parser.parse_args()
    if args.modules < 1 or args.width < 1 or args.repeats < 1:
        parser.error("--modules, --width and --repeats must be at least 1")

    import torch
    from accelerate import cpu_offload as accelerate_cpu_offload

    import swapio.offload as so
    torch.set_num_threads(1)
    x = torch.randn(4, args.width)
    models = {"resident": build(args.modules, args.width)}
    models["swapio-cpu"] = so.cpu_offload(build(args.modules, args.width))
    workdir = args.dir or tempfile.mkdtemp(prefix="tiny_modules_")
    shutil.rmtree(os.path.join(workdir, "od"), ignore_errors=True)
    models["swapio-disk"] = so.disk_offload(build(args.modules, args.width), os.path.join(workdir, "od"))
    models["accelerate"] = build(args.modules, args.width)
    accelerate_cpu_offload(models["accelerate"], execution_device=torch.device("cpu"))
    try:
        with torch.no_grad():
            want = models["resident"](x)
            for name, model in models.items():
                if not torch.equal(model(x), want):
                    raise SystemExit(f"{name}: outputs differ from the resident model's")
            times = interleaved_medians({name: (lambda m=model: m(x)) for name, model in models.items()},
                                        args.repeats)
    finally:
        so.remove_offload(models["swapio-disk"])
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"{args.modules} x Linear({args.width}, {args.width}), batch 4, one thread, medians of {args.repeats} "
          "interleaved rounds")
    for name, t in times.items():
        print(f"  {name:12s} {t * 1e3:9.2f} ms a forward  {t / args.modules * 1e6:8.1f} us a module")
    for name in ("swapio-cpu", "swapio-disk"):
        print(f"  {name} / accelerate {times[name] / times['accelerate']:.2f}   "
              f"{name} / resident {times[name] / times['resident']:.1f}")


if __name__ == "__main__":
    main()
