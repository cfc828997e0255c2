"""async_save(state, path): returns a swapio.Future once every tensor's bytes are copied (capture.py); the
file is written and committed in the background (background.py), exactly as save() would."""
import os

from . import background
from .capture import capture
from .save import DEFAULT_STAGING, prepare, write_and_commit


def async_save(state, path, *, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None):
    """Captures `state` and writes it to the safetensors file `path` in the background. The returned
    swapio.Future's wait() gives the file's size, or raises what made the save fail (the previous file at path
    is then intact). A save submitted while another is in flight starts when that one has finished."""
    slot = background.reserve()  # at most one capture waits behind the one being written: else block until one is done
    try:
        plan, pending = prepare(state, os.fspath(path), metadata, staging_bytes)
        try:
            pieces, staging = capture(plan, staging_bytes)
        except BaseException:
            pending.abort()
            raise
        plan.entries = None  # the live tensors are not needed any more (nor kept alive)
        return background.submit(lambda: write_and_commit(plan, pending, pieces, staging, handle), slot)
    except BaseException:
        slot.release_unless_taken()
        raise
