"""save_file(state, path): a training state to one safetensors file with O_DIRECT, committed atomically, through
swapio.safetensors.FileWriter: big contiguous CPU tensors from their own memory (the file starts with those whose
addresses it can match, safetensors.layout._congruent_chain), the header and the rest through pinned staging."""
import os

from ..safetensors.file_writer import DEFAULT_STAGING, FileWriter
from .format import plan_state


def save_file(state, path, *, staging_bytes=DEFAULT_STAGING, handle=None, metadata=None):
    """Writes `state` to the safetensors file `path`; returns the file's size in bytes (swapio.checkpoint.save's
    single-file case: the caller checked staging_bytes and waited for earlier async saves)."""
    plan = plan_state(state, metadata)
    with FileWriter(os.fspath(path), plan) as f:
        f.write(staging_bytes=staging_bytes, handle=handle)
        return f.commit()
