"""The files of an optimizer checkpoint directory: their names, the format's version, and what may stand in their
place (a checkpoint file is a regular file; a directory, FIFO or device there is a ValueError, never "missing")."""
import errno
import os
import stat

from ...core._owned_fd import file_kind

FILE = "swapio-optim.safetensors"
FORMAT = "swapio.optim.checkpoint"
VERSION = 4  # 2: checksums; 3: state_dtype (bf16/int8 arrays); 4: one safetensors file
MAX_GROUP_TENSOR_BYTES = 4096  # a tensor a param group holds (lr=torch.tensor(...), as torch allows; a small value
#                               of the user's): what save() writes and load() reads back, a bound on what a file may
#                               make load() read outside the state
LEGACY_META = "swapio-optim.pt"  # versions <= 3: this metadata and a swapio-optim-<hex>.bin, read only
LEGACY = (("swapio-optim-", (".bin", ".bin.tmp")), (f".{LEGACY_META}.", (".tmp",)))  # (prefix, suffixes)


def regular(where):
    """True for a regular file (symlinks followed), False when nothing is there; ValueError for anything else
    there (a directory, a FIFO that would block the reader, a device): never reported as missing."""
    try:
        mode = os.stat(where).st_mode
    except FileNotFoundError:
        if os.path.islink(where):
            raise FileNotFoundError(errno.ENOENT, "a dangling symlink in place of the checkpoint file", where) \
                from None
        return False
    if not stat.S_ISREG(mode):
        raise ValueError(f"{where} is {file_kind(mode)}, not a checkpoint file")
    return True
