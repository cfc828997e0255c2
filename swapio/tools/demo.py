"""`swapio demo`: a short training run that shows what swapio is for.

One small byte-level GPT (swapio.tools.demo_model), three identical copies trained on the same batches: with
torch.optim.AdamW, with OffloadAdamW(offload="cpu") and with OffloadAdamW(offload="nvme") (its swap file in a
temporary directory under the working directory, removed afterwards). The steps run interleaved, so the three
see the same machine. Reported: the losses at every logged step and how far they are from torch's, the median
optimizer step time, and the host memory each optimizer holds for its state, measured as the growth of the
process's resident memory over the step that creates the state (freed heap pages are returned to the OS before
each measurement, so reused memory cannot hide an allocation). optimizer="adafactor" runs torch.optim.Adafactor
and OffloadAdafactor instead (the same three columns; the first keeps its label's place as the reference).
"""
import copy
import ctypes
import dataclasses
import os
import shutil
import statistics
import time
from typing import Optional

import torch

from .. import _progress
from ..core import _swapdir
from ..optim import OffloadAdafactor, OffloadAdamW, OffloadOptimizer
from . import demo_model, hostmem

RUNS = ("torch AdamW", 'offload="cpu"', 'offload="nvme"')  # the columns (runs_of); the first is torch's
# --optimizer: (torch's class and its extra arguments, swapio's class, name)
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"fused": True}, OffloadAdamW, "AdamW"),
              "adafactor": (torch.optim.Adafactor, {}, OffloadAdafactor, "Adafactor")}


def runs_of(optimizer):
    """The three runs' labels for --optimizer (RUNS for adamw)."""
    return (f"torch {OPTIMIZERS[optimizer][3]}",) + RUNS[1:]


@dataclasses.dataclass
class DemoConfig:
    steps: int = 80
    layers: int = 3
    width: int = 96
    heads: int = 4
    context: int = 64
    batch: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.1
    log_every: int = 10
    buffer_bytes: int = 1 << 20   # pinned RAM of the nvme pipeline: smaller than the state, to show the bound
    directory: str = "."
    seed: int = 0
    optimizer: str = "adamw"  # or "adafactor" (OPTIMIZERS)
    progress: Optional[bool] = None  # True: show a bar, False: none, None: on a terminal (swapio._progress)

    def validate(self):
        for name in ("steps", "layers", "width", "heads", "context", "batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"--width {self.width} must be a multiple of --heads {self.heads}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"--lr must be positive and finite, got {self.lr}")
        if self.buffer_bytes < 4 * (64 << 10):
            raise ValueError(f"--buffer must be at least 256K (4 pinned slots of 64 KiB), got {self.buffer_bytes}")
        corpus = demo_model.corpus_bytes().numel()  # checked here, before a model of that context is built
        if self.context >= corpus - 1:
            raise ValueError(f"--context must be below {corpus - 1} (the corpus is {corpus} bytes), got {self.context}")
        hostmem.require(memory_bytes(self), f"a demo of --layers {self.layers} --width {self.width} --batch "
                        f"{self.batch} --context {self.context}", "use smaller ones")


def memory_bytes(cfg):
    """A lower bound of the host memory a demo takes: four copies of the model (the base and three trained) with
    three sets of gradients and two optimizers' fp32 moments (torch's, offload="cpu"), and what one forward saves
    for backward: per token and layer about 18 x width numbers, and the logits over the 256 bytes (fp32)."""
    w, vocab = cfg.width, demo_model.VOCAB
    params = vocab * w + cfg.context * w + cfg.layers * (12 * w * w + 13 * w) + 2 * w
    tokens = cfg.batch * cfg.context
    return 4 * (11 * params + tokens * (18 * w * cfg.layers + 4 * vocab))


@dataclasses.dataclass
class DemoResult:
    config: DemoConfig
    params: int
    corpus_bytes: int
    losses: dict          # run -> [loss at each step]
    step_seconds: dict    # run -> [seconds of each opt.step()]
    state_ram: dict       # run -> bytes of resident memory the first step added
    state_disk: int       # bytes the nvme swap file takes on disk
    state_bytes: int      # fp32 moments of the model (what torch's AdamW keeps), for reference

    @property
    def logged_steps(self):
        every = max(1, self.config.log_every)
        return sorted({s for s in range(every, self.config.steps + 1, every)} | {1, self.config.steps})

    def max_diff(self, run):
        ref = self.losses[runs_of(self.config.optimizer)[0]]
        return max(abs(a - b) for a, b in zip(self.losses[run], ref))


def _resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim_heap():
    """Return freed heap pages to the OS (glibc), so that memory the step allocates shows up as RSS growth."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _disk_bytes(directory):
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def run_demo(cfg, log=print):
    torch.manual_seed(cfg.seed)
    base = demo_model.TinyGPT(cfg.layers, cfg.width, cfg.heads, cfg.context)
    data = demo_model.corpus_bytes()
    batches = demo_model.Batches(data, cfg.context, cfg.batch, cfg.seed)
    n_params = sum(p.numel() for p in base.parameters())
    runs = runs_of(cfg.optimizer)
    models = {run: copy.deepcopy(base) for run in runs}
    # claimed as the optimizers claim theirs: one a killed run (SIGKILL) left is removed by the next run on --dir
    owner = _swapdir.private_directory(cfg.directory)
    swap_root = owner.directory
    opts = {}
    try:
        torch_cls, torch_kw, ours, _ = OPTIMIZERS[cfg.optimizer]
        opts[runs[0]] = torch_cls(models[runs[0]].parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, **torch_kw)
        opts[runs[1]] = ours(models[runs[1]].parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, offload="cpu")
        opts[runs[2]] = ours(models[runs[2]].parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             offload="nvme", swap_dir=swap_root, buffer_bytes=cfg.buffer_bytes)
        _warm_up(cfg, swap_root)
        losses = {run: [] for run in runs}
        seconds = {run: [] for run in runs}
        state_ram = {}
        bar = _progress_bar(cfg)
        for step in range(1, cfg.steps + 1):
            x, y = batches.next()
            for run in runs:
                model, opt = models[run], opts[run]
                loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if step == 1:
                    _trim_heap()
                    before = _resident_bytes()
                start = time.perf_counter()
                opt.step()
                seconds[run].append(time.perf_counter() - start)
                if step == 1:
                    _trim_heap()
                    state_ram[run] = _resident_bytes() - before
                opt.zero_grad()
                losses[run].append(loss.item())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[runs[0]][-1]:.3f}")
        if bar is not None:
            bar.close()
        state_disk = _disk_bytes(swap_root)
    finally:
        for opt in opts.values():
            if isinstance(opt, OffloadOptimizer):
                opt.close()
        owner.remove_everything()
    return DemoResult(cfg, n_params, data.numel(), losses, seconds, state_ram, state_disk, 8 * n_params)


def _warm_up(cfg, swap_root):
    """One step of each optimizer on a throwaway parameter, so that what the process sets up once, on first use,
    (the I/O engine's rings and worker threads, torch's fused kernel) is not counted as the first optimizer's
    state: it came to ~0.5 MiB and showed nvme mode holding more than the --buffer the report bounds it by."""
    torch_cls, torch_kw, ours, _ = OPTIMIZERS[cfg.optimizer]
    scratch = os.path.join(swap_root, "warm-up")
    os.mkdir(scratch)
    makers = (lambda ps: torch_cls(ps, lr=cfg.lr, **torch_kw), lambda ps: ours(ps, lr=cfg.lr, offload="cpu"),
              lambda ps: ours(ps, lr=cfg.lr, offload="nvme", swap_dir=scratch, buffer_bytes=cfg.buffer_bytes))
    for make in makers:
        p = torch.nn.Parameter(torch.zeros(4, 64))
        p.grad = torch.ones_like(p)
        opt = make([p])
        try:
            opt.step()
        finally:
            if isinstance(opt, OffloadOptimizer):
                opt.close()
    shutil.rmtree(scratch, ignore_errors=True)


def _progress_bar(cfg):
    return _progress.bar(cfg.progress, total=cfg.steps, desc="swapio demo", unit="step", leave=False)


def _mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def report(result):
    c = result.config
    name, runs = OPTIMIZERS[c.optimizer][3], runs_of(c.optimizer)
    lines = [f"swapio demo ({name}: torch's vs swapio's Offload{name}): a byte-level GPT ({c.layers} layers, "
             f"width {c.width}, {result.params / 1e6:.2f} M "
             f"fp32 parameters) on {result.corpus_bytes / 1e3:.0f} KB of Python's standard-library source, "
             f"{c.steps} steps of {c.batch} x {c.context} bytes, the same batches for each optimizer.", "",
             f"{'step':>6}  " + "  ".join(f"{run:>15}" for run in runs) + f"  {'max |diff| vs torch':>20}"]
    for s in result.logged_steps:
        row = [result.losses[run][s - 1] for run in runs]
        diff = max(abs(v - row[0]) for v in row[1:])
        lines.append(f"{s:>6}  " + "  ".join(f"{v:>15.6f}" for v in row) + f"  {diff:>20.2e}")
    med = {run: statistics.median(result.step_seconds[run][1:] or result.step_seconds[run]) for run in runs}
    lines += ["", f"{'':28}" + "".join(f"{run:>16}" for run in runs),
              f"{'loss: max |diff| vs torch':28}" + f"{'-':>16}"
              + "".join(f"{result.max_diff(run):>16.2e}" for run in runs[1:]),
              f"{'optimizer step (median)':28}" + "".join(f"{med[run] * 1e3:>13.2f} ms" for run in runs),
              f"{'host RAM held by state':28}" + "".join(f"{_mib(result.state_ram[run]):>16}" for run in runs),
              f"{'state on disk':28}" + f"{'-':>16}{'-':>16}{_mib(result.state_disk):>16}",
              "",
              "Host RAM is measured: the growth of resident memory over the step that creates the state, after a "
              "warm-up step on a throwaway parameter has paid the process's one-time setup"
              + (f" (torch's {'AdamW' if c.optimizer == 'adamw' else 'Adam'}'s fp32 moments are "
                 f"{_mib(result.state_bytes)})" if c.optimizer != "adafactor" else "")
              + ". In nvme mode it is the pinned pipeline, at most "
              + (f"--buffer ({_mib(c.buffer_bytes)}), whatever the model size"
                 if c.optimizer != "adafactor" else
                 f"--buffer ({_mib(c.buffer_bytes)}) or buffer_count x the largest parameter's record, whichever is "
                 "larger (Adafactor steps whole parameters)")
              + ", plus a little bookkeeping per parameter tensor; the state itself is on disk."]
    return "\n".join(lines)


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, style in zip(runs_of(result.config.optimizer), ("-", "--", ":")):
        ax.plot(range(1, len(result.losses[run]) + 1), result.losses[run], style, label=run)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy per byte)")
    name = OPTIMIZERS[result.config.optimizer][3]
    ax.set_title(f"swapio demo: torch {name} vs Offload{name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
