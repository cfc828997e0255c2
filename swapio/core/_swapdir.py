"""Swap directories and their owners, for SwapStore and the optimizers' nvme state.

A directory in use holds a lock file, `.swapio-owner`, with its owner's pid, locked with flock(LOCK_EX) for as
long as the owner lives; the kernel drops the lock when the process dies, however it dies (SIGKILL, the OOM
killer, a preempted job). So:
- a second live owner of the same directory is refused (the lock is held);
- a lock file that can be locked but still names a pid was left by an owner that died: the next store or
  optimizer on that swap_dir removes what it left (private `swapio-optim-*` directories whole, a store
  directory's `*.swap` files) and warns, so nothing piles up run after run;
- SIGTERM (what Slurm and Kubernetes send before SIGKILL) removes the live swap files of this process, as
  Ctrl-C does through KeyboardInterrupt, then ends the process as SIGTERM would. The handler is installed only
  where SIGTERM has its default disposition: a handler of the application's own is never replaced.
A clean release removes the lock file while still holding the lock; whoever locks a file also checks that it is
still the one at the path, so a lock on a file being removed is never mistaken for ownership.
"""
import ctypes
import errno
import fcntl
import functools
import gc
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref

from .. import _C
from . import _durable
from ._errors import file_system_key, warn_once
from ._owned_fd import OwnedFd
from ._signals import DeferredSigint

LOCK_NAME = ".swapio-owner"
PRIVATE_PREFIX = "swapio-optim-"  # private directories (mkdtemp) that a dead owner's successor may remove whole
_RAM_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}

# id(owner) -> a weak reference to it (its user holds it), for the SIGTERM handler. No lock: owners leave it in
# finalizers, which the garbage collector may run anywhere, under any lock; each access is one atomic dict operation
_live = {}
_sigterm_installed = False


def _lock_file(path):
    """(OwnedFd, previous content) with an exclusive flock on the lock file at path (dropped when it is closed),
    or (None, content) if another process holds it. Creates the file if it is missing."""
    while True:
        owned = OwnedFd.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(owned.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            content = os.pread(owned.fileno(), 64, 0)
            owned.close()
            return None, content
        except BaseException:
            owned.close()
            raise
        st = os.fstat(owned.fileno())
        try:
            now = os.lstat(path)
            same = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            return owned, os.pread(owned.fileno(), 64, 0)
        owned.close()  # the previous owner removed it between our open and our lock: try again


def lock_collecting_own_garbage(directory):
    """_lock_file on directory's lock file, but when the holder is this process, first lets the garbage collector
    finalize what holds it: a SwapStore or an offloaded model dropped without close() is a reference cycle (with
    its swapped tensors, its modules' hooks), which keeps the lock until the collector frees it, so a sweep
    rebuilding one on the same directory in a loop would be refused. (owned, content, remade): remade when the
    collected owner removed the directory, made again here."""
    lock = os.path.join(directory, LOCK_NAME)
    owned, content = _lock_file(lock)
    remade = False
    if owned is None and _pid_of(content) == os.getpid():
        gc.collect()
        remade = not os.path.isdir(directory)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        owned, content = _lock_file(lock)
    return owned, content, remade


def identity_of(fd):
    """(st_dev, st_ino, birth ns) of an open file: a file made at the same path after this one was deleted often
    gets its inode number back, never its birth time (0 where the file system keeps none: not checked)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, _C.file_birth_ns(fd)


def create_private_file(path):
    """Creates (or truncates) a 0600 regular file, refusing to follow a symlink planted at its name; returns its
    identity_of(), which the native core checks on every later open of it (pread/pwrite identity=)."""
    with OwnedFd.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600) as owned:
        os.fchmod(owned.fileno(), 0o600)
        return identity_of(owned.fileno())


def resize_private_file(path, identity, size):
    """Sets the size of the file create_private_file made, never through a symlink or on another file."""
    # NONBLOCK: a FIFO there
    with OwnedFd.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC) as owned:
        if identity_of(owned.fileno()) != identity:
            raise OSError(errno.ESTALE, "another file replaced the file expected here", path)
        os.ftruncate(owned.fileno(), size)


def _pid_of(content):
    try:
        return int(content.decode().split()[0])
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


class Owner:
    """This process's claim on a swap directory (held by `owned`, the lock file's locked OwnedFd). files: paths
    inside it removed on SIGTERM."""

    def __init__(self, directory, owned, private, created):
        self.directory, self._owned, self.private, self.created = directory, owned, private, created
        self.pid = os.getpid()
        self.files = set()
        os.ftruncate(owned.fileno(), 0)
        os.pwrite(owned.fileno(), f"{self.pid}\n".encode(), 0)
        ref = weakref.ref(self)  # (made first: an allocation may run the collector, and its finalizers)
        _live[id(self)] = ref
        _install_sigterm_handler()

    @property
    def released(self):
        """True once release() let go of the lock."""
        return self._owned.closed

    def release(self, keep_lock_file=False):
        """Removes the lock file (unless keep_lock_file) and gives up the lock (the caller removed the rest).
        Idempotent. In a forked child the parent's claim is left alone."""
        _live.pop(id(self), None)
        if self._owned.closed:
            return
        try:
            if os.getpid() == self.pid and not keep_lock_file:
                try:
                    os.unlink(os.path.join(self.directory, LOCK_NAME))
                except FileNotFoundError:
                    pass
        finally:
            self._owned.close()  # drops the lock (once, also when the SIGTERM handler releases it meanwhile)

    def __del__(self):
        # Dropped unreleased: its user was interrupted (Ctrl-C) between getting it and keeping it, so nothing can use
        # its files any more; without this the lock would stay held, and the directory kept, for the process's life
        try:
            _live.pop(id(self), None)
            if not self._owned.closed:
                self.remove_everything()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (AttributeError: __init__ interrupted)
            pass

    def remove_everything(self):
        """What SIGTERM does: every file of this owner, then the lock, the directory if the owner made it. A Ctrl-C
        meanwhile is raised once all that is done: cut short, it left files and the lock's descriptor behind."""
        if os.getpid() != self.pid:
            return
        with DeferredSigint():
            self._remove_everything()

    def _remove_everything(self):
        if self.private:
            shutil.rmtree(self.directory, ignore_errors=True)
            if os.path.lexists(self.directory):
                # Not removed (out of file descriptors, EMFILE, say): give up the lock but keep its file, which
                # names this process, so that what is left counts as a dead owner's and the next swapio user of
                # the parent reclaims it; then try again with the lock's descriptor free.
                self.release(keep_lock_file=True)
                shutil.rmtree(self.directory, ignore_errors=True)
                return
        else:
            _durable.discard(*self.files)
        self.release()
        if self.created and not self.private:
            _durable.discard(self.directory)


def claim(directory, created):
    """Claims a store's directory: OSError(EBUSY) if a live owner holds it; removes the `*.swap` files a dead
    owner left (and dead owners' private directories inside it), saying so."""
    reclaim(directory)
    owned, content, remade = lock_collecting_own_garbage(directory)
    created = created or remade
    if owned is None:
        pid = _pid_of(content)
        raise OSError(errno.EBUSY, f"another live SwapStore{f' (pid {pid})' if pid else ''} uses this directory; "
                      "two stores on one directory would overwrite and delete each other's files: give each "
                      "its own directory", directory)
    try:
        dead = _pid_of(content)
        if dead is not None:
            left = [n for n in os.listdir(directory) if n.endswith(".swap")
                    and os.path.isfile(os.path.join(directory, n)) and not os.path.islink(os.path.join(directory, n))]
            freed = 0
            for name in left:
                path = os.path.join(directory, name)
                try:
                    freed += os.lstat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            if left:
                _say(f"{directory}: removed {len(left)} swap file(s) ({freed} bytes) left by process {dead}, "
                     "which died without closing its SwapStore")
        return Owner(directory, owned, private=False, created=created)
    except BaseException:
        owned.close()
        raise


def make_parent(swap_dir):
    """Makes a swap_dir that does not exist yet (as DeepSpeed makes its swap folders); ValueError where the path
    is something else than a directory, OSError naming it where it cannot be made."""
    if os.path.lexists(swap_dir) and not os.path.isdir(swap_dir):
        raise ValueError(f"swap_dir {swap_dir!r} is not a directory")
    try:
        os.makedirs(swap_dir, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create swap_dir: {exc.strerror}", swap_dir) from None


def private_directory(parent):
    """A new private directory (mode 0700) under parent, claimed by this process; first removes the private
    directories of owners that died."""
    reclaim(parent)
    while True:
        directory = tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=parent)
        try:
            owned, _ = _lock_file(os.path.join(directory, LOCK_NAME))
            while owned is None:  # a reclaimer is looking at the new, empty lock file: it lets go at once
                time.sleep(0.001)
                owned, _ = _lock_file(os.path.join(directory, LOCK_NAME))
            return Owner(directory, owned, private=True, created=True)
        except FileNotFoundError:
            continue  # a reclaimer removed the directory while it was still empty (see reclaim): another one
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            _durable.discard(directory)  # rmdir needs no descriptor: still works when out of them (EMFILE)
            raise


def reclaim(parent):
    """Removes the private directories under parent whose owner died (lock file free but naming a pid)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PRIVATE_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(parent, name)
        lock = os.path.join(directory, LOCK_NAME)
        if os.path.islink(directory) or not os.path.isdir(directory):
            continue  # not ours
        if not os.path.lexists(lock):
            # Empty: left by a process that failed before it made its lock file (EMFILE), or one making it right
            # now, which then takes another directory (private_directory). rmdir removes only an empty one.
            _durable.discard(directory)
            continue
        if not os.path.isfile(lock):
            continue
        try:
            owned, content = _lock_file(lock)
        except OSError:
            continue
        if owned is None:
            continue  # alive
        try:
            dead = _pid_of(content)
            if dead is None:
                continue  # its owner is between creating and writing the lock file
            size = _tree_bytes(directory)
            shutil.rmtree(directory, ignore_errors=True)
            _say(f"{directory}: removed the swap directory ({size} bytes) of process {dead}, which died "
                 "without cleaning up")
        finally:
            owned.close()


def _tree_bytes(directory):
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _say(message):
    warn_once(("reclaim", message), message)


# ---- RAM-backed directories ----------------------------------------------------------------------------------------
@functools.cache
def _libc():
    # The process's own symbols, libc's among them: ctypes.util.find_library would run `ldconfig -p` in a
    # subprocess at every call (each swap directory made).
    return ctypes.CDLL(None, use_errno=True)


def ram_file_system(path):
    """"tmpfs" or "ramfs" when path lives in RAM (statfs), else None (also when it cannot be told)."""
    try:
        libc = _libc()
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first word
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    f_type = ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF
    return _RAM_FILE_SYSTEMS.get(f_type)


def warn_if_ram_backed(path, what):
    kind = ram_file_system(path)
    if kind is not None:
        warn_once(("ram", file_system_key(path)), f"{what} {path} is on {kind}, which lives in RAM: swapping there "
                  "frees no memory (use a directory on a disk)")
    return kind


# ---- SIGTERM --------------------------------------------------------------------------------------------------------
def _on_sigterm(signum, frame):
    owners = [ref() for ref in list(_live.values())]
    for owner in owners:
        if owner is None:
            continue
        try:
            owner.remove_everything()
        except Exception:  # noqa: BLE001 - the process ends anyway; remove what can be removed
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler():
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _sigterm_installed = True
    except (ValueError, OSError):  # not the main interpreter
        pass

