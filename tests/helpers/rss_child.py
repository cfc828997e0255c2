"""RSS from /proc/self/status and a reset of its peak, for the memory tests' child processes: importable, and as
PRELUDE, the same functions' source for a child started with `python -c`."""
import inspect


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak():
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


PRELUDE = "\n" + inspect.getsource(status) + "\n\n" + inspect.getsource(reset_peak)
