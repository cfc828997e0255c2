"""Streaming, atomic checkpoints of the offloaded optimizers (opt.save(dir) / opt.load(dir)).

A checkpoint is a directory holding one file, swapio-optim.safetensors, written through swapio.safetensors'
FileWriter (the one writer in the library): a safetensors file that safetensors.torch.load_file reads and
swapio.checkpoint.load(file) returns as an optimizer state dict,
    {"format", "version" (4), "optimizer" (the class), "state_dtype", "checksum" (the algorithm),
     "param_groups": as in state_dict(),
     "state": {index: {"step": int, "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"][, "master"][, "<moment>_scale"]}},
     "param_dtypes": {index: the parameter's dtype}, "checksums": {index: {field: xxh3-64, 16 hex digits}}}
whose tensors are the arrays as the optimizer stores them (swapio.optim.state_format): fp32, bf16 or int8-code
moments shaped like the parameter, fp32 masters (bf16/fp16 parameters only), flat fp32 int8 block scales.

Saving streams the arrays and never holds a second copy of the state (writer.py). A save holds the directory's
flock (swapio.core._dir_lock) exclusively, a load shared: a save while another live process saves or loads there
raises OSError(EBUSY); a save removes what killed saves left (their temporary files) and, after its commit, the
files of a version <= 3 checkpoint.

load() is all or nothing (restore.py): it validates the header and structure (reader.py, over
swapio.checkpoint.load.locate: the library's one reader) and the metadata, reads every array into new storage,
verifies the checksums, and only then swaps the new state in.

Versions <= 3 (swapio-optim.pt, torch.save metadata with offsets and checksums, beside a raw
swapio-optim-<hex>.bin) still load (legacy.py): only where the offsets and checksums come from differs (read_meta).
"""
import errno
import os

from ...core import _checksum, _dir_lock as dir_lock, _durable
from ...core._errors import check_path
from ...safetensors import commit
from .. import validate
from .files import FILE, FORMAT, LEGACY, LEGACY_META, VERSION, regular
from .legacy import read_legacy_meta
from .reader import read_meta_v4
from .restore import restore
from .writer import write_file

__all__ = ["FILE", "FORMAT", "LEGACY_META", "VERSION", "load", "read_meta", "save"]


def _not_a_directory(path, what):
    """NotADirectoryError where `path` is a file: opt.save()/opt.load() take the checkpoint's directory (a user
    may pass the swapio-optim.safetensors inside it, or any file, by mistake)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"opt.{what}() takes a checkpoint directory (which holds {FILE}), "
                                 "but this path is a file", path)


def _missing_directories(path):
    """The directories of `path` that do not exist yet, deepest first."""
    out, d = [], os.path.abspath(path)
    while not os.path.lexists(d) and os.path.dirname(d) != d:
        out.append(d)
        d = os.path.dirname(d)
    return out


def save(opt, path, progress=False):
    path = check_path("path", path)
    _not_a_directory(path, "save")
    made = _missing_directories(path)
    os.makedirs(path, exist_ok=True)
    try:
        with dir_lock.locked(path, exclusive=True):
            write_file(opt, path, progress)
            # the files this checkpoint replaced: the previous one (unlinked by a helper thread), a version <= 3 one
            commit.wait_for_unlinks()
            _durable.discard(os.path.join(path, LEGACY_META))
            for prefix, suffixes in LEGACY:
                _durable.remove_others(path, prefix, suffixes, keep=None)
    except BaseException:
        for directory in made:  # a failed first save leaves no empty directories (rmdir: only empty ones go)
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise


def load(opt, path, progress=False):
    path = check_path("path", path)
    _not_a_directory(path, "load")
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no swapio optimizer checkpoint directory", path)
    with dir_lock.locked(path, exclusive=False):  # no save removes the files while they are read
        restore(opt, read_meta(path), path, progress)


def read_meta(path):
    """The checkpoint's metadata, validated (swapio.optim.validate), in one form for every version: format,
    version, optimizer, state_dtype, checksum, param_groups, data (the file holding the arrays, in `path`),
    data_bytes, and state {index: {step, shape, numel, dtype (the parameter's), fields {field: byte offset in
    data}, checksums {field: int}}}. ValueError naming the first problem."""
    path = os.fspath(path)
    where = os.path.join(path, FILE)
    if regular(where):  # a version <= 3 checkpoint beside it is older: a save removes it after its commit
        meta = read_meta_v4(where)
    else:
        where = os.path.join(path, LEGACY_META)
        if not os.path.lexists(where):
            raise FileNotFoundError(f"{path}: no swapio optimizer checkpoint ({FILE} is missing)")
        meta = read_legacy_meta(where)
    validate.checkpoint_meta(meta, where, VERSION, _checksum.ALGORITHM)
    meta["file"] = where  # what errors name
    return meta
