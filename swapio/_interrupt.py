"""Ctrl-C in the `swapio` command: one line on stderr and exit status 130, never a traceback, wherever it lands.

The command catches KeyboardInterrupt around its own code (tools/cli.py, tools/entry.py), but both `python -m
swapio` and the `swapio` script import this package first, and that import (torch's) takes seconds: the package
imports under exits_quietly_if_the_command(). A program that imports swapio keeps its KeyboardInterrupt.
Standard library only: it runs before torch is loaded.
"""
import contextlib
import os
import sys
from typing import Iterator

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
_COMMAND = "swapio"


def interrupted(prog: str = _COMMAND) -> int:
    """Says `prog: interrupted` on stderr; returns the exit status of an interrupted command."""
    print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def is_the_command() -> bool:
    """Whether this process is the `swapio` command: `python -m swapio ...` (told while runpy imports the
    package, when sys.argv[0] is still "-m"; Python 3.10+, which keeps the command line as sys.orig_argv) or the
    `swapio` script that pip installs (sys.argv[0] names it)."""
    argv = sys.argv
    if not argv:
        return False
    if argv[0] == "-m":  # orig_argv: [python, options..., -m, MODULE (or -mMODULE), the args argv[1:] also holds]
        orig = getattr(sys, "orig_argv", None)
        if not orig or len(orig) < len(argv):
            return False
        module = orig[-len(argv)]
        module = module[2:] if module.startswith("-m") else module
        return module in (_COMMAND, f"{_COMMAND}.__main__")
    return os.path.basename(argv[0]) == _COMMAND


@contextlib.contextmanager
def exits_quietly_if_the_command() -> Iterator[None]:
    """Ctrl-C in the block exits the `swapio` command with status 130 and one line; elsewhere it propagates."""
    try:
        yield
    except KeyboardInterrupt:
        if not is_the_command():
            raise
        sys.exit(interrupted())
