"""What `swapio tune` shows of a sweep (tune.py): the summary table and the heat maps of --plot."""
import numpy as np

from .. import _C
from . import report
from .tune import TuneError


def summary(result, config_path, plot_path=None):
    c = result.config
    n = sum(len(p.gbps) for p in result.points.values())
    lines = [f"swapio tune: {n} runs of {c.point_time:g} s in {result.seconds:.0f} s on {result.directory} "
             f"({report.fmt_bytes(c.size)} file, {'O_DIRECT' if result.direct else 'buffered'}, "
             f"engines {', '.join(c.engines)})", "",
             f"{'best for':9} {'engine':7} {'bs':>6} {'iodepth':>7} {'threads':>7}  "
             + "  ".join(f"{op + ' GB/s':>10}" for op in c.ops)]
    rows = [(op, result.best[op]) for op in c.ops]
    if len(c.ops) > 1:
        rows.append(("both", result.both))
    for label, (engine, bs, qd, th) in rows:
        figs = "  ".join(f"{result.figure((engine, bs, qd, th), op):10.2f}" for op in c.ops)
        lines.append(f"{label:9} {engine:7} {report.fmt_size(bs):>6} {qd:7} {th:7}  {figs}")
    lines += ["", "GB/s = 10^9 B/s, medians of the final round.",
              f"wrote {config_path}: swapio.AioHandle.from_config({config_path!r}) uses the \"both\" settings"
              + (", from_config(json.load(open(path))['read']) the read ones" if "read" in c.ops else "")]
    if plot_path:
        lines.append(f"wrote {plot_path}")
    return "\n".join(lines)


def require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TuneError("--plot needs matplotlib: pip install 'swapio[plot]' (or pip install matplotlib)") from None


def plot(result, path):
    """Heat maps of GB/s over block size x queue depth (threads for psync), one per engine and direction;
    each cell shows the best over thread counts; the chosen setting is boxed."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result.config
    ops, engines = list(c.ops), list(c.engines)
    fig, axes = plt.subplots(len(ops), len(engines), figsize=(3.6 * len(engines) + 1, 3.2 * len(ops) + 0.6),
                             squeeze=False, layout="constrained")
    for r, op in enumerate(ops):
        pts = [p for p in result.points.values() if p.op == op]
        vmax = max((p.median for p in pts), default=1.0)
        for col, engine in enumerate(engines):
            ax = axes[r][col]
            xs = c.threads if engine in _C.SYNC_ENGINES else c.depths
            grid = np.full((len(c.block_sizes), len(xs)), np.nan)
            for p in pts:
                if p.engine != engine or p.bs not in c.block_sizes:
                    continue
                x = p.threads if engine in _C.SYNC_ENGINES else p.iodepth
                if x in xs:
                    i, j = c.block_sizes.index(p.bs), xs.index(x)
                    grid[i, j] = np.nanmax([grid[i, j], p.median])
            im = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap="viridis",
                           vmin=0, vmax=vmax)
            for (i, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.6 * vmax else "black")
            eng, bs, qd, th = result.best[op]
            if eng == engine and bs in c.block_sizes:
                x = th if engine in _C.SYNC_ENGINES else qd
                if x in xs:
                    ax.add_patch(plt.Rectangle((xs.index(x) - 0.5, c.block_sizes.index(bs) - 0.5), 1, 1,
                                               fill=False, edgecolor="red", linewidth=2))
            ax.set_xticks(range(len(xs)), [str(x) for x in xs], fontsize=7)
            ax.set_yticks(range(len(c.block_sizes)), [report.fmt_size(b) for b in c.block_sizes], fontsize=7)
            ax.set_xlabel("threads" if engine in _C.SYNC_ENGINES else "queue depth", fontsize=8)
            ax.set_ylabel("block size", fontsize=8)
            ax.set_title(f"{op}, {engine}", fontsize=9)
            ax.set_facecolor("#eeeeee")
        fig.colorbar(im, ax=list(axes[r]), label=f"{op} GB/s", shrink=0.9)
    fig.suptitle(f"swapio tune: {result.directory} ({'O_DIRECT' if result.direct else 'buffered'}); "
                 "each cell: best over thread counts; blank = not measured; red box = best", fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
