"""Shared helpers for the benchmarks: size parsing, medians, cache dropping, tables."""
import os
import re
import statistics

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (e.g. 512M, 2G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


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
