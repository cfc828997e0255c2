# The native module swapio._C (csrc/python/bindings.cpp) has no typed stubs yet: every name in it is Any to a
# type checker. The Python layer (swapio.handle, swapio.pinned, ...) is the typed public API.
from typing import Any

def __getattr__(name: str) -> Any: ...
