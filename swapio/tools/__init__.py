"""The `swapio` command and what it is built from (bench, tune, info, the load generator).

The library (swapio.*, swapio.optim, swapio.offload, swapio.checkpoint) never imports this package, and it needs
the `cli` extra (numpy, tqdm). Its public helpers, for benchmarks and scripts, are the names below; everything
else in it is the command's own.
"""
from typing import Any

_PUBLIC = {
    "parse_size": ("report", "parse_size"),        # "4K", "1.5G" -> bytes (binary, like fio)
    "fmt_size": ("report", "fmt_size"),            # bytes -> "4K", "1.5G"
    "find_fio": ("fiocompare", "find_fio"),        # fio's path, or FioError
    "fio_command": ("fiocompare", "fio_command"),  # the fio command line for swapio bench's settings
    "run_fio": ("fiocompare", "run_fio"),          # runs it; fio's figures per direction
    "FioError": ("fiocompare", "FioError"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:  # lazy, so that `swapio.tools.entry` can run before numpy is known to exist
    if name not in _PUBLIC:
        raise AttributeError(f"module 'swapio.tools' has no attribute {name!r}")
    import importlib
    module, attr = _PUBLIC[name]
    return getattr(importlib.import_module(f".{module}", __name__), attr)
