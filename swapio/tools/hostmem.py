"""Host memory a tool run may take: a run that needs more than the machine has available is refused up front (exit
2, a one-line message) instead of grinding into the OOM killer, which may pick another process than this one."""
import os

from .errors import UsageError
from .report import fmt_bytes


CGROUP = "/sys/fs/cgroup"  # cgroup v2: memory.max ("max" or bytes), memory.current


def _cgroup_limit():
    """The cgroup's memory.max in bytes (a container's memory limit), or None without one."""
    try:
        with open(f"{CGROUP}/memory.max") as f:
            limit = f.read().strip()
        return None if limit == "max" else int(limit)
    except (OSError, ValueError):
        return None


def total_bytes():
    """The RAM this process may use: the machine's, or its container's memory limit where that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return physical if limit is None else min(physical, limit)


def available_bytes():
    """What can be allocated without swapping: /proc/meminfo's MemAvailable, bounded by the cgroup's memory.max
    less what the cgroup uses; None where neither is known."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_limit()
    if limit is not None:
        try:
            with open(f"{CGROUP}/memory.current") as f:
                limits.append(max(0, limit - int(f.read())))
        except (OSError, ValueError):
            limits.append(limit)
    return min(limits) if limits else None


def require(nbytes, what, fix):
    """UsageError unless `nbytes` fit in the memory available. what: what needs them; fix: which options shrink it."""
    avail = available_bytes()
    if avail is not None and nbytes > avail:
        raise UsageError(f"{what} needs about {fmt_bytes(nbytes)} of memory, more than the {fmt_bytes(avail)} "
                         f"available here; {fix}")
