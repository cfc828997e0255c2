"""One rule for progress bars, for the `swapio` command and, later, the library (opt.save, disk_offload).

A bar is shown when asked (`progress=True`: the command's `--progress`, or SWAPIO_PROGRESS=1), hidden when told
(`progress=False`: `-q`, or SWAPIO_PROGRESS=0), and otherwise only when stderr, where it is drawn, is a
terminal. A bar redraws itself with carriage returns, which turn a log file or a CI transcript into noise, so
output that nobody watches live gets none unless asked for.
"""
import contextlib
import sys
from typing import Any, Iterator, Optional, TextIO

from . import _env

ENV = "SWAPIO_PROGRESS"


def wanted(progress: Optional[bool] = None, stream: Optional[TextIO] = None) -> bool:
    """Whether to draw a progress bar: `progress` if it is True or False; else SWAPIO_PROGRESS if set (1/0,
    true/false, yes/no, on/off; any other value warns once and is ignored); else whether `stream` (default:
    sys.stderr) is a terminal."""
    if progress is not None:
        return bool(progress)
    env = _env.switch(ENV, "a bar only when stderr is a terminal")
    if env is not None:
        return env
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def bar(progress: Optional[bool] = None, **tqdm_kwargs: Any) -> Any:
    """A tqdm bar on stderr (tqdm's keyword arguments: total, desc, unit, ...) when wanted(progress) and tqdm is
    installed, else None.
    Callers update and close it only when it is not None."""
    if not wanted(progress):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the `cli` extra; the library alone shows no bar
        return None
    tqdm_kwargs.setdefault("file", sys.stderr)
    return tqdm(**tqdm_kwargs)


@contextlib.contextmanager
def byte_bar(progress: Optional[bool], total: int, desc: str) -> Iterator[Any]:
    """bar() of `total` bytes (shown in KiB, MiB, ...) for the block, closed on leaving it; None when no bar is
    wanted."""
    shown = bar(progress, total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
    try:
        yield shown
    finally:
        if shown is not None:
            shown.close()
