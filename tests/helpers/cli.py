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
