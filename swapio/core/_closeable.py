"""Closeable: one definition of `with` support and close-at-collection."""
from typing import Any, TypeVar

_Self = TypeVar("_Self", bound="Closeable")


class Closeable:
    """`with` support and a best-effort close() at garbage collection, for objects holding files or threads."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
