"""Files that no name points to, for scratch work in a user's directory (the O_DIRECT probe, the swapio command's
bench and tune file): such a file goes with its last descriptor, so a process killed while it holds one (SIGKILL,
the OOM killer) leaves nothing behind. Opened by path as /proc/<pid>/fd/<n>, which the native engines and a
child process (fio) open like any file. Where that path does not reach the file (/proc not mounted, as in some
chroots, or another PID namespace's), a scratch file keeps a name until it is closed."""
import errno
import os
import tempfile
from typing import Union

from ._signals import DeferredSigint

# O_TMPFILE unknown to the file system (EOPNOTSUPP: NFS, /proc, /sys) or to the kernel (EISDIR, EINVAL)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def open_unnamed(directory: "Union[str, os.PathLike[str]]") -> int:
    """A descriptor (read-write, close-on-exec) of a new empty file in `directory` that has no name; OSError as
    creating a file there raises it (EACCES, EROFS, ENOSPC...)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    with DeferredSigint():  # named for a moment only, a Ctrl-C held off until the name is gone
        fd, name = tempfile.mkstemp(prefix=".swapio-scratch-", dir=directory)
        try:
            os.unlink(name)
        except BaseException:
            os.close(fd)
            raise
    return fd


def path_of(fd: int) -> str:
    """A path that opens the file of `fd`, in this process and in its children while the descriptor is open."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def reaches(path: str, fd: int) -> bool:
    """Whether `path` opens the file of `fd` (not some other process's: /proc may be another PID namespace's)."""
    try:
        by_path, by_fd = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (by_path.st_dev, by_path.st_ino) == (by_fd.st_dev, by_fd.st_ino)


class ScratchFile:
    """A new empty file in `directory` opened read-write as `fd`, and a `path` that opens it: unnamed where /proc
    reaches it, else named ``.swapio-scratch-*`` (left behind only by a process killed before close())."""

    def __init__(self, directory: "Union[str, os.PathLike[str]]") -> None:
        self.name: "Union[str, None]" = None
        self.fd = -1
        try:
            self._open(directory)
        except BaseException:  # a Ctrl-C held off while the named file was made lands as that ends: no caller
            self.close()       # has the file to close yet
            raise

    def _open(self, directory: "Union[str, os.PathLike[str]]") -> None:
        self.fd = open_unnamed(directory)
        self.path = path_of(self.fd)
        if reaches(self.path, self.fd):
            return
        fd, self.fd = self.fd, -1
        os.close(fd)
        with DeferredSigint():  # the name is known to close() before a Ctrl-C can land
            self.fd, self.name = tempfile.mkstemp(prefix=".swapio-scratch-", dir=directory)
        self.path = self.name

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        with DeferredSigint():
            os.close(fd)
            if self.name is not None:
                try:
                    os.unlink(self.name)
                except FileNotFoundError:
                    pass
