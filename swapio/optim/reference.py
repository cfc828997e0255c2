"""A state dict that refers to a checkpoint on disk instead of holding the state: what the Trainer integration
leaves in optimizer.pt, so that Trainer's torch.save writes a few bytes while swapio writes the state.

The reference names the checkpoint by its absolute path and records the identity of its file (device, inode,
size, modification time) and, for opt.save's files, a digest of the file's header, which holds a checksum of
every state array: the content. Loading takes the file at that path while it is the same file, or a copy of it
(the same header: another machine, a restored backup, a directory moved elsewhere and linked back). If another
run has rewritten it since (the same output_dir, the same step), loading would resume from another run's state
without a word: that file is refused. A resume that knows which checkpoint directory it resumes
(SwapioTrainer: resuming_from) looks for the checkpoint there first, under its recorded name, so a moved or
copied directory resumes from its own files.
"""
import contextlib
import contextvars
import hashlib
import os
import struct

REFERENCE_KEY = "swapio_checkpoint"  # the checkpoint's absolute path (opt.save's directory, or a file)
_IDENTITY_KEY = "swapio_checkpoint_identity"
_HEADER_KEY = "swapio_checkpoint_header"  # sha256 of the safetensors header (length and JSON), hex
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's length

_resume_dir: contextvars.ContextVar = contextvars.ContextVar("swapio_resume_dir", default=None)


def _identity(file):
    st = os.stat(file)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def header_digest(file):
    """sha256 (hex) of a safetensors file's header, its 8-byte length included; None where it has none."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            return None
        body = f.read(n)
    if len(body) < n:
        return None
    return hashlib.sha256(head + body).hexdigest()


def make(path, file, *, checksummed=False):
    """The reference to the checkpoint at `path` whose state `file` holds (written and renamed into place);
    checksummed: the file's header holds checksums of all its data (opt.save's), so that a copy is recognised by
    it. Its empty param_groups make any other optimizer's load_state_dict refuse it rather than load nothing."""
    ref = {"state": {}, "param_groups": [], REFERENCE_KEY: os.path.abspath(path), _IDENTITY_KEY: _identity(file)}
    if checksummed:
        ref[_HEADER_KEY] = header_digest(file)
    return ref


def target(state_dict):
    """The path a reference names (None for an ordinary state dict)."""
    return state_dict.get(REFERENCE_KEY) if isinstance(state_dict, dict) else None


@contextlib.contextmanager
def resuming_from(directory):
    """While a Trainer resumes from `directory`: a reference is looked for there first (located)."""
    token = _resume_dir.set(None if directory is None else os.fspath(directory))
    try:
        yield
    finally:
        _resume_dir.reset(token)


def located(state_dict):
    """Where to load a reference from: the entry of its recorded name in the directory being resumed
    (resuming_from) when there is one, else the recorded path."""
    path = target(state_dict)
    if not isinstance(path, str):
        raise TypeError(f"an optimizer checkpoint reference names its checkpoint by a path, got {type(path).__name__}")
    resume, name = _resume_dir.get(), os.path.basename(path)
    if resume is not None and name not in ("", ".", ".."):  # (confined to the directory resumed)
        here = os.path.join(resume, name)
        if os.path.lexists(here):
            return here
    return path


def check(state_dict, path, file, how_to_load):
    """FileNotFoundError where the reference's checkpoint `file` (under `path`, where it was looked for) is gone,
    ValueError where it is neither the file the reference was made for nor a copy of it (references without an
    identity, from older versions, are taken as they are). how_to_load: what to call instead, for the messages."""
    named = target(state_dict)
    where = named if path == named else f"{named} (looked for at {path})"
    if not os.path.exists(file):
        raise FileNotFoundError(f"the optimizer checkpoint names {where}, which does not exist (was the checkpoint "
                                f"moved? resume with SwapioTrainer, which looks in the checkpoint it resumes, or "
                                f"load it with {how_to_load})")
    recorded = state_dict.get(_IDENTITY_KEY)
    if recorded is None or list(recorded) == _identity(file):
        return
    digest = state_dict.get(_HEADER_KEY)
    if digest is not None and header_digest(file) == digest:
        return  # a copy of the same save
    raise ValueError(f"the optimizer checkpoint names {where}, which has been rewritten since this reference was "
                     "saved (another run writing the same checkpoint directory?): it holds another state. Load "
                     f"the state that belongs with this checkpoint with {how_to_load}")
