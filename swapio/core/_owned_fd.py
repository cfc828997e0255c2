"""OwnedFd: a file descriptor with exactly one owner, closed exactly once, wherever an exception lands.

A Python signal handler (Ctrl-C's KeyboardInterrupt, an application's SIGALRM or SIGTERM handler) runs in the main
thread when a call returns, before its result is stored, and whatever it raises unwinds from there. A descriptor
kept as an int is then lost (`fd = os.open(...)` interrupted before the assignment), or closed by two cleanups
(a `finally` and a helper thread, each believing it is the one): the second close hits whatever file took the
number meanwhile, and that file's next read fails with EBADF or its next write lands in another file.

So a descriptor lives in an OwnedFd from the moment the kernel returns it until it is closed:
- open() records it inside C code (map() calls os.open, dict.update stores the result) before any Python
  bytecode, hence any signal handler, can run;
- close() removes it and closes it inside C code too (map() over a dict.pop): an exception lands before (still
  held: the next close closes it) or after (closed), never between. Every thread and every cleanup may call
  close(), as often as it likes: exactly one close reaches the kernel;
- an OwnedFd dropped while still open (its owner interrupted before it could close it) closes it when it is
  freed.
Nothing else closes the number: a caller that needs it borrows it with fileno() while holding the OwnedFd.
"""
import collections
import functools
import os
import stat

_KEY = ("fd",)


class OwnedFd:
    """One open file descriptor (see the module). `with OwnedFd.open(path, flags) as owned: os.fstat(owned.fileno())`."""

    __slots__ = ("_held", "_take")

    def __init__(self):
        self._held = {}  # {"fd": the descriptor} while open
        self._take = functools.partial(self._held.pop, "fd", None)  # (C: no bytecode between pop and its use)

    @classmethod
    def open(cls, path, flags, mode=0o777):
        """os.open(path, flags, mode), owned from the moment it returns; its OSError as it is."""
        owned = cls()
        owned._held.update(zip(_KEY, map(os.open, (path,), (flags,), (mode,))))
        return owned

    @classmethod
    def open_regular(cls, path, what, nofollow=False):
        """The regular file at path, read-only, opened without blocking (a FIFO in its place would block the open
        or the reads); ValueError naming what is there instead ("<path> is a FIFO, not <what>"), OSError of the
        open (with nofollow, ELOOP for a symlink)."""
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
        owned = cls.open(path, flags)
        try:
            mode = os.fstat(owned.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"{path} is {file_kind(mode)}, not {what}")
        except BaseException:
            owned.close()
            raise
        return owned

    def fileno(self):
        """The descriptor, to use (never to close) while holding this; ValueError once closed."""
        fd = self._held.get("fd")
        if fd is None:
            raise ValueError("I/O operation on a closed file descriptor")
        return fd

    @property
    def closed(self):
        return "fd" not in self._held

    def close(self):
        """Closes the descriptor unless it was closed already (by any thread); OSError of the close, if any."""
        collections.deque(map(os.close, iter(self._take, None)), maxlen=0)  # (deque runs the map inside C code)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except (OSError, AttributeError):  # never raise from a finalizer (AttributeError: __init__ interrupted)
            pass

    def __repr__(self):
        return f"OwnedFd({self._held.get('fd', 'closed')})"


def file_kind(mode):
    """What a file of this st_mode is, in words, for an error."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a regular file")
