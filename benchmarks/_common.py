"""Shared helpers for the benchmarks: medians, cache dropping, tables (sizes: swapio.tools.parse_size).

Import this first: it puts the checkout ahead of any installed swapio on sys.path, so the benchmarks run from
an in-place build (`python setup.py build_ext --inplace`) as they are.
"""
import os
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def kernel_banner(repeats):
    """The first line of a kernel benchmark: the SIMD levels torch and swapio run, and how figures are taken."""
    import torch

    import swapio.ops as sops
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), swapio kernel: "
          f"{sops.cpu_capability()}; medians of {repeats} interleaved rounds; Gp/s = 1e9 params/s")


# After a parallel torch operator, torch's OpenMP threads spin-wait for more work for about 10 ms (GOMP_SPINCOUNT),
# taking cores from whatever runs next: each timed call starts after this pause, so that no method pays for the
# one before it.
SETTLE_S = 0.03


def interleaved_medians(fns, repeats):
    """{name: median seconds of fn()} over `repeats` rounds that run every fn in turn (drift hits all alike),
    after one warm-up call each (page faults, thread pools, lazy state); SETTLE_S before each call."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(ts) for k, ts in times.items()}


def median(values):
    return statistics.median(values) if values else float("nan")


def drop_caches():
    """Drops the page cache (root only) so reads come from the device; returns whether it could."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def print_table(headers, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = "  ".join(f"{{:>{w}}}" for w in widths)
    print(line.format(*headers))
    for row in rows:
        print(line.format(*row))


def io_bytes():
    """(bytes read, bytes written) by this process that reached the storage (/proc/self/io: O_DIRECT included)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out["read_bytes"], out["write_bytes"]


def proc_status(key):
    """A /proc/self/status field in bytes (VmRSS, VmHWM: peak RSS, VmLck: locked)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss():
    """Resets VmHWM to the current RSS (Linux >= 4.0; where the kernel cannot, the peak stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_with_peak_rss(fn):
    """(seconds, peak resident growth in bytes, result) of fn(), sampling RSS every 2 ms on a helper thread."""
    base = resident_bytes()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    done.set()
    t.join()
    return seconds, max(peak[0], resident_bytes()) - base, result
