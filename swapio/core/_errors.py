"""Warnings and argument checks shared by the Python layer."""
import numbers
import os
import sys
import types
import warnings
from typing import Hashable, NoReturn, Optional, Set, SupportsIndex, Union

StrPath = Union[str, "os.PathLike[str]"]  # a path argument: str or pathlib.Path


class SwapioWarning(UserWarning):
    """Something degraded (buffered I/O fallback, unlocked memory) but the call goes on."""


_warned: Set[Hashable] = set()


def warn_once(key: Hashable, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, SwapioWarning, stacklevel=3)


def file_system_key(path: str) -> Hashable:
    """What a warning about the file system holding `path` is given once for: its device (each nvme optimizer and
    activation offload writes in a private directory with a new name, so a key per directory warned, and was kept,
    once more per rebuild); the path where it cannot be read."""
    try:
        return ("device", os.stat(path).st_dev)
    except OSError:
        return path


def caller_stacklevel() -> int:
    """warnings.warn's stacklevel, from the function calling this one, of the first frame outside swapio and torch:
    the caller's line, whatever wrappers lie between (torch.compile's around swapio's boundaries come and go)."""
    level = 1
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("swapio", "torch"):
        level, frame = level + 1, frame.f_back
    return level


def check_int(name: str, value: object, minimum: Optional[int] = None,
              maximum: Optional[int] = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def check_bool(name: str, value: object, allowed: str = "True or False") -> bool:
    """value as a bool: True, False, or numpy's bool (what comparing numpy numbers gives; it was refused as "got
    bool"). TypeError naming `name` otherwise: an int or a str there is likely a mistake."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be {allowed}, got {kind.__name__}")


def check_progress(progress: object) -> Optional[bool]:
    """A public `progress=` argument: None, or a bool (numpy's too). An int or a str there is likely a mistake,
    refused before any work starts (1 was taken by opt.save where disk_offload refused it)."""
    return None if progress is None else check_bool("progress", progress, "None, True or False")


def check_path(name: str, value: StrPath) -> str:
    """A path argument as a str: a bytes path (or a PathLike giving bytes) as os.fsdecode reads it, as open() takes
    both (swapio joins str names to it). An empty one is a ValueError: as a directory it meant the current one,
    which got the files (an unset environment variable, most likely; "." says it)."""
    try:
        path = os.fsdecode(os.fspath(value))
    except TypeError:
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}") from None
    if not path:
        raise ValueError(f"{name} is an empty path (for the current directory, pass '.')")
    return path



class NotCopyable:
    """copy, deepcopy and pickle raise a TypeError: the object owns native requests, threads or files that a copy
    would share without owning (a dropped shallow copy of a store would close the original's files)."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(f"a swapio {type(self).__name__} cannot be copied or pickled (copy.copy, copy.deepcopy, "
                        "pickle): it owns native I/O requests, worker threads or swap files; make a new one instead")
