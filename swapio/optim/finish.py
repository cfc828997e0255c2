"""Waiting for everything before raising: a buffer may be dropped only when no I/O still writes into it."""


def finish_all(calls):
    """Calls every one of `calls` (each waits for something: a future, a slot), then raises the first error any
    raised, so that no I/O still writes into memory about to be dropped when the error propagates."""
    error = None
    for call in calls:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the first error is raised below
            error = error or exc
    if error is not None:
        raise error
