"""Where a step's time goes: the counters behind opt.step_report() (docs/optim.md, "Seeing where time goes").

A backend owns one IoClock and adds to it as it works: seconds in the update kernel, seconds the calling thread
waited for I/O (nvme reads and writes, GPU copies out of the staging buffers), bytes read and written. The
counters only grow (checkpoint reads and writes go through the same pipeline); the optimizer takes the
difference around each step, so a step's figures are that step's alone. time.perf_counter() around calls that
happen anyway: no synchronisation is added.
"""
import time

FIELDS = ("kernel_s", "io_wait_s", "bytes_read", "bytes_written")


class IoClock:
    __slots__ = FIELDS

    def __init__(self):
        self.kernel_s = self.io_wait_s = 0.0
        self.bytes_read = self.bytes_written = 0

    def snapshot(self):
        return tuple(getattr(self, k) for k in FIELDS)


def figures(wall_s, steps, before, after):
    """A report entry: the step count, wall time, the clock's deltas between snapshots, and rates."""
    out = {"steps": steps, "wall_s": wall_s}
    out.update({k: b - a for k, a, b in zip(FIELDS, before, after)})
    out["other_s"] = max(0.0, wall_s - out["kernel_s"] - out["io_wait_s"])
    out["read_gbps"] = out["bytes_read"] / wall_s / 1e9 if wall_s > 0 else 0.0
    out["write_gbps"] = out["bytes_written"] / wall_s / 1e9 if wall_s > 0 else 0.0
    return out


def add(total, last):
    """total + last, field by field (rates recomputed from the sums)."""
    if total is None:
        return dict(last)
    out = {k: total[k] + last[k] for k in ("steps", "wall_s", *FIELDS, "other_s")}
    out["read_gbps"] = out["bytes_read"] / out["wall_s"] / 1e9 if out["wall_s"] > 0 else 0.0
    out["write_gbps"] = out["bytes_written"] / out["wall_s"] / 1e9 if out["wall_s"] > 0 else 0.0
    return out


now = time.perf_counter
