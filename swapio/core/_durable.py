"""Crash-safe commits of files, shared by optimizer checkpoints (swapio.optim.checkpoint) and offload directories
(swapio.offload.offload_dir): data is written under a temporary name, fsynced, renamed into place, and the
directory fsynced, so after a crash a reader finds the old file or the new one, never a torn one."""
import os


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp, final):
    """Makes the finished file tmp durable under the name final."""
    fsync_path(tmp)
    os.rename(tmp, final)
    fsync_path(os.path.dirname(final) or ".", directory=True)


def write_and_replace(tmp, final, write, written=None, mode="wb"):
    """write(f) into a new file tmp, fsync it, rename it over final (the commit point) and fsync the directory.
    written: None, or a list that gets tmp's (st_dev, st_ino) before the rename, so that a caller interrupted
    after it can ask the file system whether final is already the new file (see is_file)."""
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        if written is not None:
            st = os.fstat(f.fileno())
            written.append((st.st_dev, st.st_ino))
    os.replace(tmp, final)
    fsync_path(os.path.dirname(final) or ".", directory=True)


def is_file(path, ident):
    """True when path is the file with (st_dev, st_ino) ident."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == ident


def discard(*paths):
    """Removes each path (a file, or a directory if it is empty), quietly: one already gone, or a directory
    that still holds someone else's files, stays as it is."""
    for path in paths:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:
            pass


def remove_others(directory, prefix, suffixes, keep):
    """Removes the files in directory named prefix...suffix (one of suffixes) but keep: data of earlier commits and
    of interrupted ones."""
    for name in os.listdir(directory):
        if name != keep and name.startswith(prefix) and name.endswith(tuple(suffixes)):
            discard(os.path.join(directory, name))
