"""Runs fio with the settings of a `swapio bench` phase, on the same file (`swapio bench --compare-fio`)."""
import contextlib
import json
import os
import shlex
import signal
import shutil
import subprocess

from .errors import ToolError

# swapio engine -> fio ioengine
FIO_ENGINES = {"uring": "io_uring", "aio": "libaio", "psync": "psync", "null": "null"}

INSTALL_HINT = ("fio is not installed (or not on PATH): install it with `apt-get install fio`, "
                "`dnf install fio` or `brew install fio`, or drop --compare-fio")


class FioError(ToolError):
    """fio is missing, failed, or printed something that is not its JSON."""


def find_fio():
    path = shutil.which("fio")
    if path is None:
        raise FioError(INSTALL_HINT)
    return path


def fio_version(fio):
    try:
        out = subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise FioError(f"cannot run {fio}: {e}") from None
    return out or "fio"


def fio_command(fio, *, path, rw, bs, iodepth, threads, size, engine, direct, runtime=None, warmup=0.0,
                loops=1):
    """The fio command line for one phase. Threads become fio jobs, each taking a 1/threads stripe of the file
    (like swapio's workers); the jobs are reported together (--group_reporting)."""
    cmd = [fio, "--name=swapio-compare", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={iodepth}", f"--ioengine={FIO_ENGINES[engine]}", f"--direct={int(bool(direct))}",
           f"--numjobs={threads}", "--group_reporting", "--lat_percentiles=1", "--output-format=json"]
    if threads > 1:
        stripe = size // threads // bs * bs
        cmd += [f"--size={stripe}", f"--offset_increment={stripe}"]
    else:
        cmd += [f"--size={size}"]
    if runtime:
        cmd += ["--time_based", f"--runtime={runtime:g}s"]
    else:
        cmd += [f"--loops={loops}"]
    if warmup:
        cmd += [f"--ramp_time={warmup:g}s"]
    return cmd


def run_fio(cmd, timeout=None):
    """Runs fio; returns its jobs[0] (the group-reported job). FioError on any failure.

    fio runs in a process group of its own, killed whole if the run ends early (time limit, Ctrl-C, SIGTERM):
    fio forks a process per job, which outlive a kill of the main one alone."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as e:
        raise FioError(f"cannot run fio: {e}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:
        _kill_group(proc)
        if isinstance(e, subprocess.TimeoutExpired):
            raise FioError(f"fio did not finish within {timeout:.0f} s") from None
        raise
    start = out.find("{")
    if proc.returncode != 0 or start < 0:
        detail = (err.strip() or out.strip() or f"exit status {proc.returncode}").splitlines()
        raise FioError(f"fio failed: {detail[-1] if detail else proc.returncode}")
    try:
        doc = json.loads(out[start:])
    except json.JSONDecodeError as e:
        raise FioError(f"cannot read fio's JSON output: {e}") from None
    job = doc["jobs"][0]
    if job.get("error"):
        raise FioError(f"fio reported error {job['error']}")
    return job


def _kill_group(proc):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()  # reaps fio, closes the pipes


def format_command(cmd):
    return " ".join(shlex.quote(c) for c in ["fio", *cmd[1:]])
