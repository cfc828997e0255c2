"""save and load as users call them: ordered after the async saves queued before them, and the one place that
sends the distributed case (save(distributed=True), a directory such a save wrote) to sharded.py; one file goes
to save.py / load.py."""
import errno
import os

from ..core._errors import check_bool, check_path
from ..safetensors.buffers import check_handle, check_staging_bytes
from ..safetensors.file_writer import DEFAULT_STAGING
from ..safetensors.opened import open_checkpoint
from . import background, load as single, sharded
from .format import check_metadata_type
from .save import save_file


def _path(path):
    """path as a str (a bytes path as os.fsdecode gives it: open() takes both, swapio's path handling str)."""
    return check_path("path", path)


def save(state, path, *, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None, distributed=False,
         group=None):
    """Writes `state` to the safetensors file `path`; returns the file's size in bytes. metadata: more {str: str}
    for the header's __metadata__. distributed=True: a collective of `group` (default: the world) where each rank
    saves its own state into the directory `path` (sharded.py). Saves land in the order they were called: this
    first waits for every async_save queued before it (their errors stay with their futures)."""
    path = _path(path)
    staging_bytes = check_staging_bytes(staging_bytes)
    check_handle(handle)
    check_metadata_type(metadata)  # (a distributed save makes its directory first)
    distributed = check_bool("distributed", distributed)  # ("False" was a distributed save)
    background.wait_all()
    if distributed:
        return sharded.save(state, path, group=group, staging_bytes=staging_bytes, handle=handle, metadata=metadata)
    return save_file(state, path, staging_bytes=staging_bytes, handle=handle, metadata=metadata)


def load(path, *, device="cpu", out=None, staging_bytes=single.DEFAULT_STAGING, handle=None, group=None):
    """The state saved at `path` (see load.py). out: a structure holding a tensor for every tensor of the
    checkpoint (same names; e.g. what state_dict() returns), filled in place; the returned structure then holds
    those tensors (and the saved non-tensor values). A directory saved with distributed=True loads this rank's
    state (group: the process group, default the world)."""
    path = _path(path)
    staging_bytes = check_staging_bytes(staging_bytes)
    check_handle(handle)
    background.wait_all()  # async_saves queued before this call land first (as save() does): it reads what they wrote
    if not os.path.exists(path):  # (a dangling symlink included) an OSError like open()'s, not a ValueError
        raise FileNotFoundError(errno.ENOENT, f"checkpoint {path} does not exist", path)
    if sharded.is_sharded(path):
        return sharded.load(path, group=group, device=device, out=out, staging_bytes=staging_bytes, handle=handle)
    device = single.device_of(device)
    return single.read_state(open_checkpoint(path), device=device, out=out, staging_bytes=staging_bytes,
                             handle=handle)
