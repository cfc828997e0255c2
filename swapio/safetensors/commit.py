"""The temporary file a checkpoint is written to, and its commit: nothing appears under the final name until
every byte is on disk.

The data go to `.<name>.swapio-ckpt-<token>.tmp` next to the final file; commit() truncates it to its true size,
fsyncs it, renames it over the final name and fsyncs the directory (swapio.core._durable.publish). Any failure or
interruption before the rename removes the temporary file; after it, the new file is the checkpoint (whether the
rename happened is asked of the file system, since a signal can land between the rename and any flag we set).

While it writes, the owner holds an exclusive flock on the temporary file. A process killed mid-save (SIGKILL,
OOM) cannot remove its file, but the kernel drops its lock: the next save into the directory removes every
temporary file whose lock it can take, and never one a live save (in any process) still holds.

Every descriptor here is an OwnedFd (swapio.core._owned_fd): held from the moment it is opened, closed exactly
once, whatever a signal handler raises wherever it lands. A save interrupted before it holds its temporary file
leaves that file unlocked (its OwnedFd, dropped, closes it): the next save removes it.
"""
import errno
import fcntl
import os
import secrets
import threading

from ..core import _durable
from ..core._owned_fd import OwnedFd

TAG = ".swapio-ckpt-"
SUFFIX = ".tmp"


_unlinking: list = []  # (helper thread, OwnedFd of the replaced file) per commit that replaced a file
_unlinking_lock = threading.Lock()


def _fresh_after_fork():  # the parent's unlinking threads are not in a forked child; its lock may be held
    global _unlinking, _unlinking_lock
    _unlinking, _unlinking_lock = [], threading.Lock()


os.register_at_fork(after_in_child=_fresh_after_fork)


def wait_for_unlinks():
    """Waits until the files replaced by earlier commits are freed."""
    with _unlinking_lock:
        jobs, _unlinking[:] = list(_unlinking), []
    for thread, replaced in jobs:
        replaced.close()  # closed here unless its thread did (a thread whose start was interrupted never runs)
        if thread.is_alive():
            thread.join()


def _is_ours(name):
    return name.startswith(".") and TAG in name and name.endswith(SUFFIX)


def reclaim(directory):
    """Removes the temporary files of saves that died (unlocked); returns their names."""
    removed = []
    try:
        names = [n for n in os.listdir(directory) if _is_ours(n)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            owned = OwnedFd.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, or a symlink: not ours
        with owned:
            try:
                fcntl.flock(owned.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(owned.fileno())
                if _durable.is_file(path, (st.st_dev, st.st_ino)):
                    os.unlink(path)  # still holding the lock, so no live writer can have it
                    removed.append(name)
            except OSError:
                pass  # a live save holds it
    return removed


def _open_quietly(path):
    """A read-only OwnedFd of the regular file at path, or None (none there, a symlink, unreadable)."""
    try:
        return OwnedFd.open_regular(path, "a checkpoint file", nofollow=True)
    except (OSError, ValueError):
        return None


def _close_on_helper(replaced):
    """Closes `replaced` (an OwnedFd) on a helper thread: the last close of an unlinked file frees its blocks.
    Where the thread cannot start, or its start is interrupted, it is closed here instead. The thread may have
    started all the same (an interruption inside Thread.start() cannot tell): whichever of the two closes first
    closes it, the other finds it closed."""
    thread = threading.Thread(target=replaced.close, name="swapio-checkpoint-unlink", daemon=True)
    with _unlinking_lock:
        finished = [job for job in _unlinking if not job[0].is_alive()]
        _unlinking[:] = [job for job in _unlinking if job[0].is_alive()] + [(thread, replaced)]
    for _, earlier in finished:
        earlier.close()  # (closed by its thread already, unless an interrupted commit's thread never ran)
    try:
        thread.start()
    except BaseException as exc:
        replaced.close()
        if not isinstance(exc, RuntimeError):  # no thread (the process's limit): the save is done all the same,
            raise                              # it only waited for the close (raised, it looked failed)


_SLASHES = tuple({"/", os.sep, os.altsep or os.sep})


def _refuse(exc, final):
    return OSError(exc.errno, f"cannot write the checkpoint {final}: {exc.strerror}", final)


class PendingFile:
    """A locked temporary file for `final`; commit() publishes it, abort() removes it (unless committed)."""

    def __init__(self, final):
        given = os.fsdecode(os.fspath(final))
        self.final = os.path.abspath(given)
        directory, base = os.path.split(self.final)
        if not base or given.endswith(_SLASHES):  # (abspath drops the trailing slash: "ck/" became the file "ck")
            raise OSError(errno.EISDIR, "a checkpoint path must name a file, not a directory (it ends in a slash)",
                          given)
        if os.path.isdir(self.final):
            raise OSError(errno.EISDIR, f"cannot write the checkpoint {self.final}: it is a directory", self.final)
        reclaim(directory)
        while True:
            self.path = os.path.join(directory, f".{base[:180]}{TAG}{secrets.token_hex(8)}{SUFFIX}")
            try:
                owned = OwnedFd.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     0o644)
            except OSError as exc:
                raise _refuse(exc, self.final) from None
            try:
                fcntl.flock(owned.fileno(), fcntl.LOCK_EX)
                st = os.fstat(owned.fileno())
                self.identity = (st.st_dev, st.st_ino)
                if _durable.is_file(self.path, self.identity):
                    break
            except BaseException:
                owned.close()
                raise
            owned.close()  # another save's reclaim removed it between our create and our lock: again
        self._owned = owned
        self.committed = False

    def commit(self, size):
        """Truncates to size, fsyncs, renames over the final name, fsyncs the directory. The file it replaces is
        held open across the rename, so that the rename does not free its blocks: freeing a GiB-sized file's
        extents takes 0.2-0.3 s on ext4, done afterwards on a helper thread that closes it instead. It has no name
        meanwhile: a process that dies first leaves nothing behind (the kernel closes and frees it)."""
        os.ftruncate(self._owned.fileno(), size)
        replaced = _open_quietly(self.final)  # (an interruption before the try below: dropped, it closes itself)
        try:
            _durable.publish(self.path, self.final)
            self.committed = True
            self.close()
        finally:
            if replaced is not None:
                _close_on_helper(replaced)

    def abort(self):
        if self._owned.closed:
            return
        if not (self.committed or _durable.is_file(self.final, self.identity)):
            _durable.discard(self.path)
        self.close()

    def close(self):
        self._owned.close()  # drops the lock (once, however often it is called)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.abort()
        return False


def commit_pending(pending, size):
    """Publishes a file of `size` bytes written to pending; OSError named after the final file, not the temporary
    one (nor the rename's pair)."""
    try:
        pending.commit(size)
    except OSError as exc:
        raise OSError(exc.errno, f"committing the checkpoint {pending.final} failed: {exc.strerror or exc}",
                      pending.final) from exc
