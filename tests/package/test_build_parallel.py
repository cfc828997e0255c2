"""setup.py compiles csrc/'s sources in parallel, also in pip's isolated build (no -j there). build_ext's own
`parallel` option runs extensions in parallel, and swapio has one, so the sources used to compile one at a time.

A stand-in compiler (a shell script) logs when each call starts and ends, and takes 0.15 s; with two jobs two
calls are seen open at once, with one job never."""
import os
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_COMPILER = """#!/bin/sh
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo start >> "$FAKECC_LOG"
sleep 0.15
mkdir -p "$(dirname "$out")" && : > "$out"
echo end >> "$FAKECC_LOG"
"""

pytest.importorskip("pybind11")


def _most_calls_open_at_once(tmp_path, jobs):
    cc = tmp_path / "fakecc"
    cc.write_text(FAKE_COMPILER)
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    env = dict(os.environ, FAKECC_LOG=str(log), CC=str(cc), CXX=str(cc), LDSHARED=f"{cc} -shared",
               SWAPIO_BUILD_JOBS=str(jobs))
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path / "lib"), "-t",
                    str(tmp_path / "obj")], cwd=ROOT, env=env, check=True, capture_output=True)
    events = log.read_text().split()
    assert events.count("start") >= 10  # every source went through the compiler (and the link)
    open_now = most = 0
    for e in events:
        open_now += 1 if e == "start" else -1
        most = max(most, open_now)
    return most


def test_sources_compile_in_parallel(tmp_path):
    assert _most_calls_open_at_once(tmp_path, jobs=2) == 2


def test_swapio_build_jobs_1_compiles_one_at_a_time(tmp_path):
    assert _most_calls_open_at_once(tmp_path, jobs=1) == 1
