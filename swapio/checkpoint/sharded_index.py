"""The index of a sharded checkpoint, path/swapio-checkpoint.json, and the names of its rank files: what
save(..., distributed=True) commits (sharded.py) and the only thing load trusts.

Format version 2 (this swapio): {"format": FORMAT, "format_version": 2, "world_size": n, "save_id": id,
"files": ["rank-0-<id>.safetensors", ...]}. Each save writes its rank files under names of its own (its save id,
16 hex digits), so the files of the committed checkpoint stay untouched until the new index replaces the old one
(the commit point); files the index does not name (an earlier save's, an interrupted one's) are never read, and
the next complete save removes them. Version 1 (earlier swapio: no format_version) named rank-{r}.safetensors,
replaced in place; it still loads.

The index comes from outside: every name in it must be exactly the one a save writes for that rank, a file of the
directory (a link only to a file inside it), else a ValueError naming the index.
"""
import json
import os
import re
import secrets

from ..core import _durable
from ..core._owned_fd import OwnedFd
from ..safetensors.files import _confined
from ..safetensors.header import strict_json

INDEX = "swapio-checkpoint.json"
FORMAT = "swapio.checkpoint.sharded"
VERSION = 2
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_RANK_FILE = re.compile(r"rank-(0|[1-9][0-9]*)(-[0-9a-f]{16})?\.safetensors")  # only names a save writes
MAX_INDEX = 16 << 20  # bytes: an index of some 300,000 ranks
MAX_WORLD = 2 ** 31 - 1
_INDEX_TMP = re.compile(re.escape(f".{INDEX}.") + r"[0-9a-f]{16}\.tmp")


def new_save_id():
    return secrets.token_hex(8)


def rank_file_name(rank, save_id=None):
    """The name of rank's file of the save save_id (None: format version 1's)."""
    return f"rank-{rank}.safetensors" if save_id is None else f"rank-{rank}-{save_id}.safetensors"


def exists(path):
    """Whether path is a directory with an index: anything under the index's name (a FIFO, a directory, a
    dangling link) is then Index's to refuse, naming it, rather than read as another kind of checkpoint."""
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, INDEX))


def _read_regular(path, limit):
    """Up to limit bytes of the regular file at path; ValueError for anything else (a FIFO opened without blocking,
    a directory, a device)."""
    with OwnedFd.open_regular(path, "a swapio sharded checkpoint index") as owned:
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(owned.fileno(), left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


class Index:
    """A committed index, checked: world_size, save_id (a str); file_of(rank) the path of rank's file."""

    def __init__(self, path):
        self.path = os.path.join(path, INDEX)
        data = _read_regular(self.path, MAX_INDEX + 1)
        if len(data) > MAX_INDEX:  # (what a save writes is ~50 bytes a rank: not one swapio wrote)
            raise ValueError(f"{self.path}: larger than {MAX_INDEX >> 20} MiB: not a swapio sharded checkpoint index")
        raw = strict_json(data, self.path)  # no RecursionError, no duplicate keys
        try:
            version = raw.get("format_version", 1)
            world, save_id = raw["world_size"], raw["save_id"]
            if raw.get("format") != FORMAT or type(world) is not int or world < 1 or type(version) is not int:
                raise ValueError  # (not 1.7 read as 1, nor true)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{self.path}: not a swapio sharded checkpoint index") from None
        if world > MAX_WORLD:
            raise ValueError(f"{self.path}: a world size of {str(world)[:30]} ranks: not a swapio sharded checkpoint "
                             f"index (torch.distributed counts ranks in 32 bits)")
        if not 1 <= version <= VERSION:
            raise ValueError(f"{self.path}: sharded checkpoint format version {version}; this swapio reads versions "
                             f"1 to {VERSION}")
        if version == 1:
            self.save_id, file_id = str(save_id), None
            files = raw.get("files")  # (optional in version 1: then the names a save writes)
        else:
            if not (isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id)):
                raise ValueError(f"{self.path}: malformed save_id {str(save_id)[:100]!r} (16 hex digits expected)")
            self.save_id, file_id = save_id, save_id
            files = raw.get("files")
        # compared name by name, never built for world_size ranks (the index may claim 10**9 of them)
        if not ((version == 1 and files is None) or (type(files) is list and len(files) == world and all(
                name == rank_file_name(r, file_id) for r, name in enumerate(files)))):
            raise ValueError(f"{self.path}: the index names the files {str(files)[:200]}, where a save with "
                             f"{world} ranks and save id {self.save_id[:100]!r} writes "
                             f"{[rank_file_name(r, file_id) for r in range(min(world, 3))]}...: refused")
        self.world_size, self.directory, self._file_id = world, path, file_id

    def file_of(self, rank):
        """The path of rank's file: inside the directory (ValueError otherwise, or when it is missing)."""
        file = _confined(self.directory, rank_file_name(rank, self._file_id), self.path)
        if not os.path.isfile(file):  # (a FIFO never opened: it would wait for a writer)
            what = "is not a regular file" if os.path.exists(file) else "does not exist"
            raise ValueError(f"{self.path} names {file}, which {what}")
        return file


def committed_save_id(path):
    """The save id of the index committed in path now, or None (none there, unreadable, malformed)."""
    try:
        return Index(path).save_id
    except (OSError, ValueError):
        return None


def commit(path, world, save_id):
    """Writes the index naming save_id's rank files and renames it over the previous one, fsynced with the
    directory: the commit point of a sharded save. An error or interruption removes the temporary file unless the
    rename happened (the new index is then committed, and the error raised all the same)."""
    index = {"format": FORMAT, "format_version": VERSION, "world_size": world, "save_id": save_id,
             "files": [rank_file_name(r, save_id) for r in range(world)]}
    final, tmp, written = os.path.join(path, INDEX), os.path.join(path, f".{INDEX}.{save_id}.tmp"), []
    try:
        _durable.write_and_replace(tmp, final, lambda f: json.dump(index, f), written, mode="w")
    except BaseException:
        # a signal can land between the rename and any flag set after it: ask the file system
        if not (written and _durable.is_file(final, written[0])):
            _durable.discard(tmp)
        raise


def remove_stale(path, keep, owns, index_temps=False):
    """Removes the rank files in path of the ranks owns(rank) accepts, but those named in keep: earlier saves' and
    interrupted ones'; with index_temps also the temporary index files of interrupted commits. Quietly: it runs
    after the commit point, and whatever it cannot remove, the next save tries again."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        rank_file = _RANK_FILE.fullmatch(name)
        if (rank_file and owns(int(rank_file.group(1))) and name not in keep) \
                or (index_temps and _INDEX_TMP.fullmatch(name)):
            _durable.discard(os.path.join(path, name))
