"""Waiting for everything before raising: a buffer may be dropped only when no I/O still writes into it."""


def finish_all(calls):
    """Calls every one of `calls` (each waits for something: a future, a slot), then raises the first error any
    raised, so that no I/O still writes into memory about to be dropped when the error propagates. A Ctrl-C (any
    BaseException that is not an Exception) met meanwhile is raised in preference: the user's, never dropped for
    an I/O error (which stays its __context__)."""
    error = None
    for call in calls:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - raised below
            if error is None:
                error = exc
            elif isinstance(error, Exception) and not isinstance(exc, Exception):
                if exc.__context__ is None:
                    exc.__context__ = error
                error = exc
    if error is not None:
        raise error
