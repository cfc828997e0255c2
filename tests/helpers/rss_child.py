"""Code the memory tests' child processes start with: RSS from /proc/self/status and a reset of its peak."""
PRELUDE = """
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak():
    \"\"\"Resets VmHWM to the current RSS (Linux >= 4.0); False where the kernel cannot.\"\"\"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
"""
