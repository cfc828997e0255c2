"""A state dict that refers to a checkpoint on disk instead of holding the state: what the Trainer integration
leaves in optimizer.pt, so that Trainer's torch.save writes a few bytes while swapio writes the state.

The reference names the checkpoint by its absolute path and records the identity of its file (device, inode,
size, modification time). A checkpoint directory copied elsewhere still names the original; if another run has
rewritten that one since (the same output_dir, the same step), loading it would resume from another run's state
without a word, so a file that is no longer the one the reference was made for is refused."""
import os

REFERENCE_KEY = "swapio_checkpoint"  # the checkpoint's absolute path (opt.save's directory, or a file)
_IDENTITY_KEY = "swapio_checkpoint_identity"


def _identity(file):
    st = os.stat(file)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def make(path, file):
    """The reference to the checkpoint at `path` whose state `file` holds (written and renamed into place). Its
    empty param_groups make any other optimizer's load_state_dict refuse it rather than load nothing."""
    return {"state": {}, "param_groups": [], REFERENCE_KEY: os.path.abspath(path), _IDENTITY_KEY: _identity(file)}


def target(state_dict):
    """The path a reference names (None for an ordinary state dict)."""
    return state_dict.get(REFERENCE_KEY) if isinstance(state_dict, dict) else None


def check(state_dict, file, how_to_load):
    """FileNotFoundError where the reference's checkpoint `file` is gone, ValueError where it is not the file the
    reference was made for (references without an identity, from older versions, are taken as they are).
    how_to_load: what to call instead, for the messages."""
    path = target(state_dict)
    if not os.path.exists(file):
        raise FileNotFoundError(f"the optimizer checkpoint names {path}, which does not exist (was the checkpoint "
                                f"moved? load it with {how_to_load})")
    recorded = state_dict.get(_IDENTITY_KEY)
    if recorded is not None and list(recorded) != _identity(file):
        raise ValueError(f"the optimizer checkpoint names {path}, which has been rewritten since this reference was "
                         "saved (another run writing the same checkpoint directory?): it holds another state. Load "
                         f"the state that belongs with this checkpoint with {how_to_load}")
