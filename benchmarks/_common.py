"""Shared helpers for the benchmarks: medians, cache dropping, tables (sizes: swapio.tools.parse_size).

Import this first: it puts the checkout ahead of any installed swapio on sys.path, so the benchmarks run from
an in-place build (`python setup.py build_ext --inplace`) as they are.
"""
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


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
