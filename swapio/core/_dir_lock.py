"""Who is using a checkpoint directory: an flock on the directory itself (no lock file to leave behind), shared
by load() and exclusive for save() (the optimizers' checkpoints; rank 0 of a distributed checkpoint save). The
kernel drops it when its holder dies, however it dies, so a save that holds it knows every temporary file in the
directory was left by a save that is over (killed, or failed), and removes them; while another live process saves
or loads there, a save refuses (EBUSY) rather than touch its files."""
import contextlib
import errno
import fcntl
import os

from ._owned_fd import OwnedFd

# some network file systems; Lustre mounted with noflock (ENOSYS)
_UNSUPPORTED = (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


@contextlib.contextmanager
def locked(path, exclusive, what="optimizer checkpoint directory"):
    """Holds the directory's lock for the block: exclusive (save) or shared (load). OSError(EBUSY) when a live
    process holds it the other way (or, for exclusive, at all). Where the file system has no flock, runs
    unlocked (one writer per directory is then up to the caller)."""
    with OwnedFd.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) as owned:  # its close drops the lock
        try:
            fcntl.flock(owned.fileno(), (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            # (flock conflicts between two opens of the directory, so the holder may be this very process)
            if exclusive:
                message = (f"another live process (or another save or load of this one) is using this {what}; a "
                           "save there now would overwrite or delete its files: wait for it, or save elsewhere")
            else:
                message = (f"another live process (or another save of this one) is saving into this {what}; a "
                           "load now would read files it has not finished: wait for it")
            raise OSError(errno.EBUSY, message, path) from None
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
        yield
