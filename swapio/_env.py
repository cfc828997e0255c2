"""On/off environment switches (SWAPIO_PROGRESS, SWAPIO_DEBUG): one reading of their values for all of them.

A value swapio cannot read warns, naming the variable, the value and the accepted ones, then counts as unset, as
an unknown SWAPIO_CPU_CAPABILITY does: these are preferences (a bar, tracebacks), not worth stopping a run for.
"""
import os
import warnings
from typing import Optional, Set, Tuple

from .core._errors import SwapioWarning, caller_stacklevel

YES, NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_warned: Set[Tuple[str, str]] = set()  # (variable, value) already warned about: once per process, not per read


def switch(name: str, unset_means: str) -> Optional[bool]:
    """True or False when the environment variable `name` says so (1/0, true/false, yes/no, on/off, any case,
    spaces around ignored); None when it is unset or empty, or holds anything else, which warns once per value.
    `unset_means`: what applies then, for the warning ("a bar only when stderr is a terminal")."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in YES:
        return True
    if value in NO:
        return False
    if value and (name, raw) not in _warned:
        _warned.add((name, raw))
        warnings.warn(f"{name}={raw!r} is not one of {', '.join(YES)} (on) or {', '.join(NO)} (off); ignored: "
                      f"{unset_means}", SwapioWarning, stacklevel=caller_stacklevel())
    return None
