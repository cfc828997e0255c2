"""Units, latency statistics and output for `swapio bench`: fio-shaped JSON, a human table, a fio comparison.

Sizes are binary, as in fio (kb_base=1024): 4K = 4096 bytes, 1M = 2^20. Bandwidth is printed both ways and
says which: MiB/s (2^20 B/s) and GB/s (10^9 B/s).
"""
import contextlib
import math
import os
import re
import stat

import numpy as np

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtTpP]?)(?:i?[bB])?\s*")
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "h": 3600.0}
_TIME_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|us|s|m|h)?\s*")

# fio's default completion-latency percentiles, and how it spells them as JSON keys
FIO_PERCENTILES = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9,
                   99.95, 99.99)


def pct_key(p):
    return f"{p:.6f}"


def parse_size(text):
    """'4096', '4k', '128K', '1M', '1MiB', '2G', '1.5G' -> bytes (binary units); ValueError otherwise."""
    m = _SIZE_RE.fullmatch(str(text))
    if not m and str(text).strip().startswith("-"):
        raise ValueError(f"{text!r}: a size cannot be negative")
    if not m:
        raise ValueError(f"cannot parse {text!r} as a size (a number with an optional K, M, G or T suffix)")
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()]
    if not math.isfinite(value):  # hundreds of digits: float() gives inf, which no int holds
        raise ValueError(f"{text!r} is too large a size")
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def write_text_atomic(path, text):
    """Writes text to path through a temporary name and a rename: readers see the old file or the new one.

    A symlink is followed (its target gets the text, the link stays), and a path that exists but is not a
    regular file (/dev/null, /dev/stdout, a FIFO) is written in place: renaming over it would replace the
    device or pipe with a plain file (as root, /dev/null itself)."""
    try:
        old = os.stat(path)
    except FileNotFoundError:
        old = None  # a new file (or a dangling link's target, which realpath names): the umask's default mode
    if old is not None and not stat.S_ISREG(old.st_mode):
        with open(path, "w") as f:
            f.write(text)
        return
    path = os.path.realpath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if old is None else _kept_mode(old))
        with open(fd, "w") as f:
            if old is not None:
                _keep_owner_and_mode(fd, old)
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _kept_mode(st):
    return stat.S_IMODE(st.st_mode) & 0o777  # the set-id bits go, as on any write to a file


def _keep_owner_and_mode(fd, st):
    """The file replaced keeps its permissions, and its owner and group where this process may give them, as
    `cp` over a file and editors keep them (a 0600 config became 0644 at the next `swapio tune`). The new file
    was created no wider than the old one, so it is never readable by more while it is written."""
    with contextlib.suppress(PermissionError):  # another user's file, a group we are not in: ours
        os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, _kept_mode(st))  # after fchown, which may clear bits; back what the umask took off


def parse_duration(text):
    """'10', '10s', '500ms', '2m' -> seconds (float); ValueError otherwise."""
    m = _TIME_RE.fullmatch(str(text))
    if not m and str(text).strip().startswith("-"):
        raise ValueError(f"{text!r}: a duration cannot be negative")
    if not m:
        raise ValueError(f"cannot parse {text!r} as a duration (seconds, or with a ms, s, m or h suffix)")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2) or ""]
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is too long a duration")
    return seconds


def fmt_size(n):
    """Bytes as the shortest exact binary size: 4096 -> '4K', 1048576 -> '1M', 1000 -> '1000'."""
    for unit in ("P", "T", "G", "M", "K"):
        if n and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return str(n)


def fmt_bytes(n):
    """Bytes for people: '1.00 GiB', '512 MiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def fmt_ns(ns):
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "-"
    if ns < 1e3:
        return f"{ns:.0f}ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f}us" if ns < 1e5 else f"{ns / 1e3:.0f}us"
    if ns < 1e9:
        return f"{ns / 1e6:.2f}ms" if ns < 1e8 else f"{ns / 1e6:.0f}ms"
    return f"{ns / 1e9:.2f}s"


def fmt_iops(x):
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def latency_stats(lat_ns):
    """fio's clat_ns block from an array of latencies in ns: min, max, mean, stddev, N, percentile{...}.

    Percentiles are exact (nearest rank over every sample), where fio reads them off a log-linear histogram.
    """
    lat = np.sort(np.asarray(lat_ns, dtype=np.float64))
    n = int(lat.size)
    if n == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0,
                "percentile": {pct_key(p): 0 for p in FIO_PERCENTILES}}
    ranks = [min(n - 1, max(0, math.ceil(p / 100.0 * n) - 1)) for p in FIO_PERCENTILES]
    return {
        "min": int(lat[0]),
        "max": int(lat[-1]),
        "mean": float(lat.mean()),
        "stddev": float(lat.std(ddof=1)) if n > 1 else 0.0,
        "N": n,
        "percentile": {pct_key(p): int(lat[r]) for p, r in zip(FIO_PERCENTILES, ranks)},
    }


def direction_json(phase):
    """One direction ('read' or 'write') the way fio reports it; zeros when the run had no such phase."""
    if phase is None:
        empty = latency_stats([])
        return {"io_bytes": 0, "io_kbytes": 0, "bw_bytes": 0, "bw": 0, "iops": 0.0, "runtime": 0,
                "total_ios": 0, "short_ios": 0, "drop_ios": 0, "clat_ns": empty, "lat_ns": dict(empty),
                "bw_mib_s": 0.0, "bw_gb_s": 0.0, "usr_cpu": 0.0, "sys_cpu": 0.0}
    bw = phase.bytes / phase.elapsed if phase.elapsed > 0 else 0.0
    stats = latency_stats(phase.lat_ns)
    return {
        "io_bytes": int(phase.bytes),
        "io_kbytes": int(phase.bytes // 1024),
        "bw_bytes": int(bw),
        "bw": int(bw / 1024),                    # KiB/s, like fio
        "iops": phase.ios / phase.elapsed if phase.elapsed > 0 else 0.0,
        "runtime": int(round(phase.elapsed * 1000)),  # ms, like fio
        "total_ios": int(phase.ios),
        "short_ios": 0,
        "drop_ios": 0,
        "clat_ns": stats,
        "lat_ns": dict(stats),
        # swapio's additions (fio readers ignore them)
        "bw_mib_s": bw / (1 << 20),
        "bw_gb_s": bw / 1e9,
        "usr_cpu": phase.usr_cpu,
        "sys_cpu": phase.sys_cpu,
    }


def _pct(d, p):
    return d["percentile"].get(pct_key(p), 0) if d and d.get("N") else float("nan")


def bench_table(result):
    """The human table: one line per phase."""
    doc = result.json()
    job = doc["jobs"][0]
    sw = job["swapio"]
    mode = "O_DIRECT" if sw["direct"] else "buffered"
    lines = [f"swapio bench: {sw['description']}, {fmt_bytes(sw['size'])} file {sw['filename']}",
             f"  bs {fmt_size(sw['bs'])}, iodepth {sw['iodepth']}, threads {sw['threads']}, "
             f"engine {sw['engine']}, {mode}" + (f", {sw['limit']}" if sw.get("limit") else "")]
    lat_cols = ("min", "mean", "p50", "p90", "p99", "p99.9", "max")
    lines += ["",
              f"{'':9}  {'bandwidth':-^15} {'':7}  {' completion latency per piece ':-^62}  {' CPU % ':-^11}",
              f"{'':9}  {'MiB/s':>7} {'GB/s':>7} {'IOPS':>7}  " + " ".join(f"{c:>8}" for c in lat_cols)
              + f"  {'usr':>5} {'sys':>5}"]
    for name in sw["phases"]:
        label, direction = name.split(":")
        d = job[direction]
        lat = d["clat_ns"]
        values = (lat["min"], lat["mean"], _pct(lat, 50), _pct(lat, 90), _pct(lat, 99), _pct(lat, 99.9), lat["max"])
        lines.append(f"{label:9}  {d['bw_mib_s']:7.0f} {d['bw_gb_s']:7.3f} {fmt_iops(d['iops']):>7}  "
                     + " ".join(f"{fmt_ns(v):>8}" for v in values)
                     + f"  {d['usr_cpu']:5.1f} {d['sys_cpu']:5.1f}")
    lines.append("")
    lines.append("MiB/s = 2^20 B/s, GB/s = 10^9 B/s. Latency: each block-size piece, submit to completion, "
                 "timed in the native core.")
    lines.append("CPU: user and system time of the whole process, % of one core.")
    if sw.get("verify"):
        lines.append(f"verify: {sw['verify']}")
    if "fio" in doc:
        lines.append("")
        lines.append(compare_table(doc))
    return "\n".join(lines)


def compare_rows(doc):
    """(phase, key, metric, swapio, fio, better) rows for the fio comparison."""
    rows = []
    job = doc["jobs"][0]
    for name in job["swapio"]["phases"]:
        label, direction = name.split(":")
        ours = job[direction]
        theirs = doc["fio"]["phases"].get(name)
        if theirs is None:
            continue
        t = theirs["job"][direction]
        rows.append((label, "bw", "bandwidth GB/s", ours["bw_gb_s"], t["bw_bytes"] / 1e9, "higher"))
        rows.append((label, "iops", "IOPS", ours["iops"], t["iops"], "higher"))
        for p in (50.0, 99.0, 99.9):
            rows.append((label, f"lat_p{p:g}", f"p{p:g} latency", _pct(ours["lat_ns"], p), _pct(t["lat_ns"], p),
                         "lower"))
        rows.append((label, "cpu", "CPU % (usr+sys)", ours["usr_cpu"] + ours["sys_cpu"],
                     theirs["job"]["usr_cpu"] + theirs["job"]["sys_cpu"], "lower"))
    return rows


def compare_table(doc):
    fio = doc["fio"]
    lines = [f"swapio vs {fio['version']} on the same file with the same settings (ratio = swapio / fio):",
             f"{'':9} {'':17} {'swapio':>10} {'fio':>10} {'ratio':>7}"]
    for label, _, metric, ours, theirs, better in compare_rows(doc):
        if "latency" in metric:
            a, b = fmt_ns(ours), fmt_ns(theirs)
        elif metric == "IOPS":
            a, b = fmt_iops(ours), fmt_iops(theirs)
        else:
            a, b = (f"{ours:.3f}", f"{theirs:.3f}") if "GB/s" in metric else (f"{ours:.1f}", f"{theirs:.1f}")
        ratio = ours / theirs if theirs and not math.isnan(theirs) and not math.isnan(ours) else float("nan")
        lines.append(f"{label:9} {metric:17} {a:>10} {b:>10} {ratio:7.2f}  ({better} is better)")
    for cmd in fio["commands"]:
        lines.append("  $ " + cmd)
    return "\n".join(lines)
