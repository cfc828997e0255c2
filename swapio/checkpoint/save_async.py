"""async_save(state, path): returns a swapio.Future once every tensor's bytes are copied (capture.py); the
file is written and committed in the background (background.py), exactly as save() would."""
from ..core._errors import check_path
from ..safetensors.buffers import check_handle, check_staging_bytes
from ..safetensors.file_writer import DEFAULT_STAGING, FileWriter
from . import background
from .capture import capture
from .format import plan_state


def async_save(state, path, *, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None):
    """Captures `state` and writes it to the safetensors file `path` in the background. The returned
    swapio.Future's wait() gives the file's size, or raises what made the save fail (the previous file at path
    is then intact). A save submitted while another is in flight starts when that one has finished."""
    slot = background.Slot()
    try:
        slot.reserve()  # at most one capture waits behind the one being written: else block until one is done
        staging_bytes = check_staging_bytes(staging_bytes)
        check_handle(handle)
        plan = plan_state(state, metadata)
        f = FileWriter(check_path("path", path), plan)  # (a bytes path as its str, as save() takes it)
        try:
            pieces, staging = capture(plan, staging_bytes)
        except BaseException:
            f.abort()
            raise
        plan.entries = None  # the live tensors are not needed any more (nor kept alive)

        def write_and_commit():
            with f:
                f.write_pieces(pieces, staging, handle=handle, stop=background.abandoned)
                return f.commit()
        try:
            return background.submit(write_and_commit, slot)
        except RuntimeError:  # no writer thread: nothing was queued, and the temporary file would stay
            f.abort()
            raise
    except BaseException:
        slot.release_unless_taken()
        raise
