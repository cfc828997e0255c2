"""Crash-safe commits of files, shared by checkpoints (swapio.safetensors.commit, which every safetensors file
swapio writes goes through) and offload directories (swapio.offload.offload_dir): data is written under a
temporary name, fsynced, renamed into place, and the directory fsynced, so after a crash a reader finds the old
file or the new one, never a torn one."""
import os

from ._owned_fd import OwnedFd


def fsync_path(path, directory=False):
    with OwnedFd.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_CLOEXEC) as owned:
        os.fsync(owned.fileno())


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


def commit_data_and_index(tmp_data, data_path, tmp_index, index_path, write_index, mode="wb"):
    """The two-file commit of offload directories: the finished data file tmp_data is
    published as data_path, then the index naming it is written (write_index(f)) and renamed over index_path,
    the commit point. A failure, a signal included, removes what this commit made, except after the commit
    point: the data file is then the new index's, and stays. Removing older data files is the caller's."""
    written = []
    try:
        publish(tmp_data, data_path)
        write_and_replace(tmp_index, index_path, write_index, written, mode)
    except BaseException:
        # a signal can land between the rename and any flag set after it: ask the file system what is committed
        committed = bool(written) and is_file(index_path, written[0])
        discard(tmp_data, tmp_index, *(() if committed else (data_path,)))
        raise


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
