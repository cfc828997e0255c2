"""One live model per offload_dir, and the leftovers of a model whose process died.

A model offloaded to a directory reads its data file for as long as it lives, and a second disk_offload into
that directory would replace (and so delete) that file. The directory is therefore claimed the way SwapStore
claims its own (swapio.core._swapdir): the lock file `.swapio-owner` holds an flock for the model's lifetime, which
the kernel drops however the process ends. A second claim, from this process or another, is refused with EBUSY.

Holding the lock also makes cleaning up safe: no live swapio user reads anything in the directory, so whatever
a killed writer left there (temporary data and index files, a data file published but never named by the
index) is removed, and the space comes back, before anything is read or written.
"""
import errno
import os
import stat

from ..core import _durable, _swapdir
from ..core._errors import warn_once
from ..safetensors.header import MAX_HEADER, strict_json

INDEX = "swapio-weights.json"
DATA_PREFIX, DATA_SUFFIX = "swapio-weights-", ".bin"
TMP_PREFIXES = (f".{DATA_PREFIX}", f".{INDEX}.")  # what offload_dir.write names its files until they commit


class Claim:
    """This process's claim on an offload_dir (a _swapdir.Owner). Given up by release(), and also when it is
    dropped: a Ctrl-C that lands between taking the claim and handing it to the model must not leave the lock
    held for the rest of the process."""

    def __init__(self, owner, created):
        self.owner, self.created = owner, created
        self.source = None  # the fingerprint of the checkpoint the weights derive from (source.py), if any

    @property
    def files(self):
        """Paths a SIGTERM removes (the temporary files while they are written)."""
        return self.owner.files

    def release(self, remove_directory=False):
        """Gives the directory up (idempotent), removing it too when asked and empty."""
        self.owner.release()
        if remove_directory:
            _durable.discard(self.owner.directory)

    def __del__(self):
        try:
            self.owner.release()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def claim(directory):
    """A Claim on directory, made if missing (claim.created says so). OSError(EBUSY) while a live model uses it."""
    created = not os.path.exists(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create offload_dir: {exc.strerror}", directory) from None
    try:
        lock = os.path.join(directory, _swapdir.LOCK_NAME)
        # (an offloaded model of this process dropped without remove_offload: collected first)
        owned, content, remade = _swapdir.lock_collecting_own_garbage(directory)
        created = created or remade
        if owned is None:
            pid = _swapdir._pid_of(content)
            who = " of this process" if pid == os.getpid() else f" (pid {pid})" if pid else ""
            raise OSError(errno.EBUSY, f"a live offloaded model (or SwapStore){who} uses this offload_dir: "
                          "writing into it would delete the weights that model reads. Call remove_offload on it "
                          "first, or give each model its own offload_dir", directory)
        try:
            return Claim(_swapdir.Owner(directory, owned, private=False, created=created), created)
        except BaseException:
            if created:  # ours alone: nobody else could have locked it yet
                _durable.discard(lock)
            owned.close()
            raise
    except BaseException:
        if created:
            _durable.discard(directory)  # only if empty
        raise


def committed_data(directory):
    """The data file name the directory's index commits to; "" when there is no index; None when the index
    cannot be read (then no data file can be told to be unused)."""
    path = os.path.join(directory, INDEX)
    if not os.path.lexists(path):
        return ""
    try:
        with open(path, "rb") as f:
            name = strict_json(f.read(MAX_HEADER + 1), path).get("data")  # (never a RecursionError)
    except (OSError, ValueError, AttributeError):
        return None
    plain = isinstance(name, str) and os.path.basename(name) == name and name.startswith(DATA_PREFIX) \
        and name.endswith(DATA_SUFFIX)
    return name if plain else None


def remove_leftovers(directory, keep=None):
    """Removes what interrupted or killed writers left in directory (needs the claim): temporary files, and data
    files but `keep` (None: the one the index commits to)."""
    keep = committed_data(directory) if keep is None else keep
    removed, freed = 0, 0
    for name in os.listdir(directory):
        stale_tmp = name.startswith(TMP_PREFIXES) and name.endswith(".tmp")
        stale_data = keep is not None and name != keep and name.startswith(DATA_PREFIX) and name.endswith(DATA_SUFFIX)
        if not (stale_tmp or stale_data):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue  # not a file swapio writes: leave it to its owner
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed, freed = removed + 1, freed + st.st_size
    return removed, freed


def reclaim(directory):
    """remove_leftovers, saying so when a killed swapio process had left something."""
    removed, freed = remove_leftovers(directory)
    if removed:
        warn_once(("offload-reclaim", directory, removed, freed),
                  f"{directory}: removed {removed} file(s) ({freed} bytes) left by an interrupted offload")

