"""Which files a safetensors checkpoint path names, and the raw header of each.

A checkpoint is a .safetensors file (an 8-byte little-endian header length N, N bytes of JSON, then the data), a
directory holding `model.safetensors` or the sharded `model.safetensors.index.json` ({"weight_map": {name: shard
file}}) that save_pretrained writes, or that index file itself. The index comes from outside like the files: its
shard names must stay inside its directory. Every defect is a ValueError naming the file.
"""
import errno
import os
import struct

from ..core._swapdir import identity_of
from .header import MAX_HEADER, strict_json

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def raw_header(path):
    """(the header's JSON bytes, the file's size, its source: (path with links resolved, identity_of the file read,
    its (size, mtime ns))) of one .safetensors file; ValueError naming it if it cannot hold a header. The size and identity are those of
    the file the header was read from, whatever replaces it at its name meanwhile."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        # the links resolved, and checked by the identity at each read (pread opens it without following a link)
        source = (os.path.realpath(path), identity_of(f.fileno()), (st.st_size, st.st_mtime_ns))
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path}: not a safetensors file or truncated (header length {n}, file {size} "
                             "bytes)")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"{path}: the file shrank while its header was read ({len(raw)} of {n} bytes)")
    return raw, size, source


LOADING = ("while it was being loaded", "load it again once it is written")


class WrittenInPlace(OSError, ValueError):
    """check_unchanged's error: an OSError (ESTALE, as for a file replaced at its name; filename: the file) that
    is also a ValueError, as other defects of a checkpoint's data are."""


def check_unchanged(locations, during=LOADING):
    """WrittenInPlace naming the file where one the Locations were read from was written in place since its header was
    read (same file, another size or modification time: a program that writes over it without a rename, such as cp
    or open(path, "wb")): what was read may mix its old and new bytes. A file replaced by another at its name is
    not: the reads were tied to the old one (Location). `during`: (when, what to do) for the message. One stat of
    each file, after the reads; a rewrite keeping the size within the clock tick of the file's last write (its
    mtime unchanged) goes unseen."""
    for loc in {loc.path: loc for loc in locations if loc.source is not None}.values():
        real, identity, (size, mtime_ns) = loc.source
        try:
            st = os.stat(real)
        except FileNotFoundError:
            continue  # replaced or removed since: the reads, tied to the file, read it whole
        if (st.st_dev, st.st_ino) == tuple(identity[:2]) and (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            when, advice = during
            raise WrittenInPlace(errno.ESTALE, f"the file was written {when} (another program writing over it "
                                 "without a rename, such as cp?), so the tensors read from it may mix its old and "
                                 f"new bytes: {advice}", loc.path)


def wait_checked(reads, check):
    """Waits for reads from checkpoint files, then runs check() (check_unchanged of those files) before the bytes
    are used. A read that failed (OSError: past the end of a file rewritten shorter) is said as the rewrite when
    check() finds one, else raised as it is."""
    try:
        for read in reads:
            read.wait()
    except OSError:
        check()
        raise
    check()


def _confined(base, shard, index_path):
    """The path of shard `shard` named by the index at index_path, in directory base; ValueError unless it is a
    relative name of a file inside base. A link is followed only to a file inside base or inside the directory
    the index itself really lives in (the Hugging Face cache keeps a snapshot's files as links into blobs/)."""
    if not isinstance(shard, str) or not shard or "\0" in shard:
        raise ValueError(f"{index_path}: a weight_map entry must be a shard file name, got {shard!r}")
    if os.path.isabs(shard) or os.pardir in shard.replace("\\", "/").split("/"):
        raise ValueError(f"{index_path}: shard {shard!r} lies outside the checkpoint directory {base} (absolute, "
                         "or with '..'): refused")
    full = os.path.join(base, shard)
    real = os.path.realpath(full)
    allowed = {os.path.realpath(base), os.path.dirname(os.path.realpath(index_path))}
    if not any(os.path.commonpath([real, d]) == d for d in allowed):
        raise ValueError(f"{index_path}: shard {shard!r} is a link to {real}, outside the checkpoint directory "
                         f"{base}: refused")
    return full


def checkpoint_files(checkpoint):
    """The .safetensors files of a checkpoint path (file, directory, or index), and the index's weight map."""
    path = os.fspath(checkpoint)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, SINGLE)):
            return [os.path.join(path, SINGLE)], None
        if os.path.isfile(os.path.join(path, INDEX)):
            path = os.path.join(path, INDEX)
        else:
            raise ValueError(f"checkpoint directory {path} has neither {SINGLE} nor {INDEX}")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} does not exist or is not a file")
    if not path.endswith(".json"):
        return [path], None
    with open(path, "rb") as f:
        index = strict_json(f.read(MAX_HEADER + 1), path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path}: not a safetensors index (needs a JSON object with a 'weight_map')")
    if not weight_map:
        raise ValueError(f"{path}: the index's 'weight_map' is empty: it names no tensor and no shard file")
    base = os.path.dirname(path)
    by_name = {name: _confined(base, shard, path) for name, shard in weight_map.items()}
    files = list(dict.fromkeys(by_name.values()))
    for full in files:
        if not os.path.isfile(full):
            raise ValueError(f"{path} names shard {full}, which does not exist")
    return files, by_name
