"""Closeable: one definition of `with` support and close-at-collection."""


class Closeable:
    """`with` support and a best-effort close() at garbage collection, for objects holding files or threads."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
