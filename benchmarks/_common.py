"""Shared helpers for the benchmarks: medians, cache dropping, tables (sizes: swapio.report.parse_size)."""
import os
import statistics


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
