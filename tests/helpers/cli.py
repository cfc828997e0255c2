"""Shared helpers for the tests/test_cli_*.py files."""
import os

from swapio.tools import cli


def run_cli(capsys, *argv):
    """Runs `swapio ARGV` in-process; returns (exit status, stdout, stderr)."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *needles):
    assert rc not in (0, None), err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]


def leftovers(directory):
    return sorted(f for f in os.listdir(directory) if not f.startswith("."))


def signal_once_ready(start, sig, timeout, when_ready=None, cwd=None):
    """Starts a child (`start(fd)` -> (argv, env), the child told the write end `fd` of a pipe), waits until it
    writes b"r" there (where it then waits for the signal), calls when_ready(), sends `sig`; returns (status,
    stderr). The child gets SIGINT at its default even where the tests run with it ignored (a background job of a
    non-interactive shell): Python then installs its Ctrl-C handler."""
    import select
    import signal
    import subprocess
    ready, ready_in_child = os.pipe()
    argv, env = start(ready_in_child)
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            pass_fds=(ready_in_child,),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(ready_in_child)
    try:
        readable, _, _ = select.select([ready], [], [], timeout)
        got = os.read(ready, 1) if readable else None
        assert got == b"r", f"the child never got ready: {proc.communicate() if got == b'' else 'timed out'}"
        if when_ready is not None:
            when_ready()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        os.close(ready)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err
