"""The file a bench or tune run works on, and its cleanup."""
import contextlib
import os
import signal
import threading

from ..core._unnamed_file import ScratchFile, open_unnamed
from .errors import PathError, ToolError
from .report import fmt_bytes


class TestFile:
    """A temporary file in `directory` (default: the working directory) that no name points to, so it goes with
    the process however that ends (SIGKILL included; where /proc is not mounted it has a name until finish()), or the
    named `file` (removed only if this run created it and then failed). `path` opens it (for a temporary file
    /proc/<pid>/fd/<n>, which fio opens too); `shown` names it in reports."""

    __test__ = False  # not a pytest class

    def __init__(self, file=None, directory=None):
        self.temporary = file is None
        self.created = False
        self._scratch = None
        if self.temporary:
            self.directory = os.path.abspath(directory or os.getcwd())
            check_directory(self.directory, "--dir" if directory else "working directory")
            self._scratch = ScratchFile(self.directory)
            self.path = self._scratch.path
            self.shown = self._scratch.name or os.path.join(self.directory, "(unnamed temporary file)")
            self.created = True
            return
        # a symlink's target: its directory is checked, its disk's free space counted, the target created
        self.path = self.shown = os.path.realpath(file)
        self.directory = os.path.dirname(self.path)
        check_directory(self.directory, "--file's directory")
        if os.path.exists(self.path):
            if not os.path.isfile(self.path):
                raise PathError(f"--file {file} exists and is not a regular file")
        else:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.close(fd)
            self.created = True

    def current_size(self):
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def check_free_space(self, size):
        """ToolError unless the disk can take the file at `size` bytes."""
        need = size if self.created else max(0, size - self.current_size())
        avail = free_bytes(self.directory)
        if avail is not None and need > avail:
            raise ToolError(f"not enough free space in {self.directory}: the run needs {fmt_bytes(need)}, "
                            f"{fmt_bytes(avail)} available (use a smaller --size)")

    def finish(self, failed):
        if self.temporary:
            if self._scratch is not None:
                self._scratch.close()  # the file goes with it
        elif failed and self.created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def free_bytes(directory):
    """Bytes free for an unprivileged user in directory's file system; None where it keeps no block count
    (ramfs reports 0 blocks, 0 free: that is no limit, not a full disk)."""
    st = os.statvfs(directory)
    return None if st.f_blocks == 0 else st.f_bavail * st.f_frsize


def check_directory(directory, what):
    if not os.path.exists(directory):
        raise PathError(f"{what} {directory} does not exist")
    if not os.path.isdir(directory):
        raise PathError(f"{what} {directory} is not a directory")
    refused = creation_refused(directory)
    if refused:
        raise PathError(f"{what} {directory} is not writable ({refused})")


def creation_refused(directory):
    """Why no file can be created in `directory` (e.g. "Permission denied"), or None when one can. Tried, not
    asked of os.access, which says yes to root everywhere: on /sys and /proc the run failed only when it came to
    create its file (exit status 1, after the work), or wrote into a kernel file (--file)."""
    try:
        fd = open_unnamed(directory)  # no name in the directory: nothing left there if the process is killed
    except OSError as e:
        return f"creating a file there: {e.strerror or e}"
    os.close(fd)
    return None


@contextlib.contextmanager
def no_interrupts():
    """Cleanup must finish: hold off SIGINT while the I/O drains and the file goes (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
