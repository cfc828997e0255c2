"""Host memory a tool run may take: a run that needs more than the machine has available is refused up front (exit
2, a one-line message) instead of grinding into the OOM killer, which may pick another process than this one."""
from .errors import UsageError
from .report import fmt_bytes


def available_bytes():
    """What can be allocated without swapping: /proc/meminfo's MemAvailable, bounded by the cgroup's memory.max
    less what the cgroup uses; None where neither is known."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f_max, open("/sys/fs/cgroup/memory.current") as f_cur:
            limit = f_max.read().strip()
            if limit != "max":
                limits.append(max(0, int(limit) - int(f_cur.read())))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def require(nbytes, what, fix):
    """UsageError unless `nbytes` fit in the memory available. what: what needs them; fix: which options shrink it."""
    avail = available_bytes()
    if avail is not None and nbytes > avail:
        raise UsageError(f"{what} needs about {fmt_bytes(nbytes)} of memory, more than the {fmt_bytes(avail)} "
                         f"available here; {fix}")
