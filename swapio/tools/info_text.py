"""`swapio info` as text: what swapio.info() returns, one fact per line."""
from .. import _C


def _engines(data):
    lines = []
    for name, status in data["engines"].items():
        mark = "usable" if status == "ok" else f"unavailable ({status})"
        if name == data.get("auto_engine"):
            mark += ", picked by engine=\"auto\""
        if name not in _C.DATA_ENGINES:
            mark += ", no I/O (testing)"
        lines.append(f"  {name:6} {mark}")
    return lines


def _size(limit):
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"


def _memlock(data):
    limit = data.get("memlock_limit")
    if limit is None:
        return "unlimited (ulimit -l: page-locked buffers)"
    if data.get("cap_ipc_lock"):  # root: mlock ignores RLIMIT_MEMLOCK
        return (f"none for this process: it has CAP_IPC_LOCK (root), which locks memory past ulimit -l "
                f"({_size(limit)})")
    return f"{_size(limit)} (ulimit -l: page-locked buffers)"


def info_text(data):
    lines = [f"swapio {data['version']}  (torch {data['torch']}, Python {data['python']}, "
             f"Linux {data['kernel']})", "", "I/O engines:"]
    lines += _engines(data)
    path = data.get("path")
    if path is not None:
        lines += ["", f"path {path['path']}:"]
        if path["direct"]:
            src = "statx STATX_DIOALIGN" if path.get("alignment_from_statx") else "default, statx gave none"
            lines.append("  O_DIRECT      supported")
            lines.append(f"  alignment     memory {path['mem_align']} B, file offset and length "
                         f"{path['offset_align']} B ({src})")
        else:
            lines.append("  O_DIRECT      refused by the file system: swapio falls back to buffered I/O")
    simd = data.get("adam_simd") or "not built"
    lines += ["", f"Adam kernel SIMD  {simd}",
              f"threads           {data['threads']} (torch), {data['cpu_count']} CPUs",
              f"CUDA pinning      {'available' if data['cuda_pinning'] else 'not available (no CUDA)'}",
              f"memlock limit     {_memlock(data)}"]
    extra = {k: v for k, v in data.items() if k not in {"version", "torch", "python", "kernel", "engines",
                                                        "auto_engine", "path", "adam_simd", "threads",
                                                        "cpu_count", "cuda_pinning", "memlock_limit",
                                                        "cap_ipc_lock"}}
    for k, v in extra.items():  # whatever info() grows later still shows
        lines.append(f"{k:17} {v}")
    return "\n".join(lines)
