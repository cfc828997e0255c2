"""Warnings and argument checks shared by the Python layer."""
import numbers
import os
import warnings


class SwapioWarning(UserWarning):
    """Something degraded (buffered I/O fallback, unlocked memory) but the call goes on."""


_warned = set()


def warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, SwapioWarning, stacklevel=3)


def check_int(name, value, minimum=None, maximum=2**63 - 1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_path(name, value):
    try:
        return os.fspath(value)
    except TypeError:
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}") from None

