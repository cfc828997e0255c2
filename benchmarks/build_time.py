"""How long a fresh, isolated build takes: `pip wheel .` of the checkout's tracked files (as a fresh clone has
them) in a new temporary directory, so nothing is reused: pip makes its isolated build environment
(setuptools, pybind11), setup.py compiles every unit of csrc/ and links swapio._C. Prints wall time, the CPU
time of the build (user + system of pip and its children) and their ratio, the average number of busy CPUs:
about the number of parallel compile jobs on an idle machine, less on a loaded one.

    python benchmarks/build_time.py [--runs 1] [--jobs N]    # --jobs: SWAPIO_BUILD_JOBS (default: every CPU)

Run by .ci/run. Per-unit compile times (which units are the long ones): `SWAPIO_BUILD_JOBS=1 pip wheel -v .`.
"""
import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tracked_copy(dest):
    """Copies the files git tracks (with their working-tree contents) into dest: a fresh clone, without
    build/, an in-place swapio/_C*.so or other untracked files."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def one_build(jobs):
    """(wall seconds, CPU seconds) of one isolated `pip wheel .` of a fresh copy."""
    with tempfile.TemporaryDirectory(prefix="swapio-build-time-") as tmp:
        src = os.path.join(tmp, "src")
        tracked_copy(src)
        env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
        if jobs:
            env["SWAPIO_BUILD_JOBS"] = str(jobs)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", os.path.join(tmp, "wheel"),
                        src], check=True, env=env)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return wall, cpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--jobs", type=int, default=0, help="SWAPIO_BUILD_JOBS (default: setup.py's, every CPU)")
    args = p.parse_args()
    for run in range(1, args.runs + 1):
        load = os.getloadavg()[0]
        wall, cpu = one_build(args.jobs)
        print(f"build time (fresh isolated `pip wheel .`), run {run}: {wall:.1f} s wall, {cpu:.1f} s CPU, "
              f"{cpu / wall:.2f} CPUs busy on average; {os.cpu_count()} CPUs, load average {load:.2f} before",
              flush=True)


if __name__ == "__main__":
    main()
