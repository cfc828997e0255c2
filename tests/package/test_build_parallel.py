"""setup.py compiles csrc/'s sources in parallel, also in pip's isolated build (no -j there). build_ext's own
`parallel` option runs extensions in parallel, and swapio has one, so the sources used to compile one at a time.

A stand-in compiler (a shell script) logs when each call starts and ends. The first call stays open until a
second one has started, so a parallel build shows two calls open at once whatever the machine's load; a
sequential build cannot, and its first call gives up waiting after FAKECC_WAIT seconds (the time a wrongly
parallel build would have had to show a second call)."""
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
if mkdir "$FAKECC_LOG.first" 2>/dev/null; then  # the first call: open until another starts, or FAKECC_WAIT s
  i=0
  while [ "$(grep -c start "$FAKECC_LOG")" -lt 2 ] && [ $i -lt $((FAKECC_WAIT * 100)) ]; do
    sleep 0.01; i=$((i + 1))
  done
fi
mkdir -p "$(dirname "$out")" && : > "$out"
echo end >> "$FAKECC_LOG"
"""

pytest.importorskip("pybind11")


def _most_calls_open_at_once(tmp_path, jobs, wait):
    cc = tmp_path / "fakecc"
    cc.write_text(FAKE_COMPILER)
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    env = dict(os.environ, FAKECC_LOG=str(log), FAKECC_WAIT=str(wait), CC=str(cc), CXX=str(cc),
               LDSHARED=f"{cc} -shared", SWAPIO_BUILD_JOBS=str(jobs))
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path / "lib"), "-t",
                    str(tmp_path / "obj")], cwd=ROOT, env=env, check=True, capture_output=True)
    events = log.read_text().split()
    assert events.count("start") >= 10  # every source went through the compiler (and the link)
    open_now = most = 0
    for e in events:
        open_now += 1 if e == "start" else -1
        most = max(most, open_now)
    return most


@pytest.mark.slow
def test_sources_compile_in_parallel(tmp_path):
    assert _most_calls_open_at_once(tmp_path, jobs=2, wait=120) == 2  # the wait ends when the second starts


@pytest.mark.slow
def test_swapio_build_jobs_1_compiles_one_at_a_time(tmp_path):
    assert _most_calls_open_at_once(tmp_path, jobs=1, wait=1) == 1
