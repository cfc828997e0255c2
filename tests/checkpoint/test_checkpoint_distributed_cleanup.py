"""What save(..., distributed=True) removes once it commits, and what a failed one leaves, on a directory an
adversary or many interrupted saves filled (one rank: a gloo group of one in this process). It removes the
files a save writes and the index does not name, and nothing else: not a user's file, not the target of a link
named like a rank file, not a sibling checkpoint, not a file a crafted index names; a save that fails (ENOSPC
while writing, a path that is a file, a read-only directory) leaves the previous checkpoint loading unchanged."""
import errno
import json
import os

import pytest
import torch

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import INDEX, group_of_one, numbered_state as _state, one_rank  # noqa: F401 (a fixture)


STALE_ID = "00000000000000aa"




def _committed(path):
    with open(os.path.join(path, INDEX)) as f:
        return sorted([INDEX, *json.load(f)["files"]])


def test_a_save_removes_only_the_stale_files_a_save_writes(tmp_path, one_rank):
    path, sibling = tmp_path / "ckpt", tmp_path / "sibling"
    swapio.checkpoint.save(_state(1), sibling, distributed=True)
    sibling_before = {n: (sibling / n).read_bytes() for n in os.listdir(sibling)}
    swapio.checkpoint.save(_state(1), path, distributed=True)
    user = tmp_path / "user.txt"
    user.write_text("the user's")
    mine = {"notes.txt": b"mine", "rank-0.safetensors.bak": b"mine", "rank-x-0.safetensors": b"mine",
            f"rank-0-{STALE_ID}.safetensors.orig": b"mine", f".rank-0-{STALE_ID}.safetensors.keep": b"mine",
            "rank-00.safetensors": b"mine", f"rank-0-{STALE_ID.upper()}.safetensors": b"mine"}
    for name, data in mine.items():
        (path / name).write_bytes(data)
    stale = [f"rank-0-{STALE_ID}.safetensors", f"rank-0-{STALE_ID[::-1]}.safetensors", "rank-0.safetensors",
             "rank-3.safetensors", f"rank-9-{STALE_ID}.safetensors", f".{INDEX}.{STALE_ID}.tmp",
             f".rank-0-{STALE_ID}.safetensors.swapio-ckpt-0123456789abcdef.tmp"]  # many generations, interrupted
    for name in stale:
        (path / name).write_bytes(b"stale")
    # a stale name that links out of the directory: the link goes, its target stays
    os.symlink(user, path / f"rank-1-{STALE_ID}.safetensors")
    os.symlink(sibling / os.listdir(sibling)[0], path / f"rank-2-{STALE_ID}.safetensors")
    (path / "rank-5.safetensors").mkdir()  # a directory named like a rank file, holding a user's file
    (path / "rank-5.safetensors" / "keep.txt").write_text("mine")
    swapio.checkpoint.save(_state(2), path, distributed=True)
    assert_same(swapio.checkpoint.load(path), _state(2))
    assert sorted(os.listdir(path)) == sorted([*_committed(path), *mine, "rank-5.safetensors"])
    assert all((path / n).read_bytes() == d for n, d in mine.items())
    assert (path / "rank-5.safetensors" / "keep.txt").read_text() == "mine"
    assert user.read_text() == "the user's"
    assert {n: (sibling / n).read_bytes() for n in os.listdir(sibling)} == sibling_before
    assert_same(swapio.checkpoint.load(sibling), _state(1))


def test_a_crafted_index_makes_a_save_remove_nothing_it_names(tmp_path, one_rank):
    """The cleanup reads the directory's names, never the index: an index naming files outside (refused by load)
    does not turn a save into their remover."""
    path = tmp_path / "ckpt"
    outside = tmp_path / f"rank-0-{STALE_ID}.safetensors"
    outside.write_bytes(b"the user's")
    path.mkdir()
    (path / INDEX).write_text(json.dumps({"format": "swapio.checkpoint.sharded", "format_version": 2,
                                          "world_size": 1, "save_id": STALE_ID,
                                          "files": [f"../rank-0-{STALE_ID}.safetensors"]}))
    with pytest.raises(ValueError, match="names the files.*refused"):
        swapio.checkpoint.load(path)
    swapio.checkpoint.save(_state(2), path, distributed=True)
    assert_same(swapio.checkpoint.load(path), _state(2))
    assert outside.read_bytes() == b"the user's"


def test_enospc_while_a_rank_writes_leaves_the_previous_checkpoint_alone(small_ext4_dir, one_rank):
    path = small_ext4_dir / "ckpt"
    swapio.checkpoint.save(_state(1), path, distributed=True)
    before = sorted(os.listdir(path))
    with pytest.raises(OSError) as info:  # 64 MiB on a 48 MiB file system
        swapio.checkpoint.save({"w": torch.zeros(16 << 20)}, path, distributed=True)
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(path)) == before  # its file of this save removed, the temporary one too
    assert_same(swapio.checkpoint.load(path), _state(1))


def test_a_path_that_is_a_file_is_an_os_error_naming_it_and_stays(tmp_path, one_rank):
    path = tmp_path / "ckpt"
    path.write_bytes(b"the user's")
    with pytest.raises(OSError) as info:
        swapio.checkpoint.save(_state(1), path, distributed=True)
    assert info.value.errno == errno.EEXIST and info.value.filename == str(path)
    assert path.read_bytes() == b"the user's"


def test_a_read_only_directory_is_an_os_error_and_the_checkpoint_stays(readonly_dir, tmp_path, one_rank):
    swapio.checkpoint.save(_state(1), tmp_path / "rw" / "ckpt", distributed=True)  # (readonly_dir's source)
    path = readonly_dir / "ckpt"
    with pytest.raises(OSError) as info:
        swapio.checkpoint.save(_state(2), path, distributed=True)
    assert info.value.errno in (errno.EROFS, errno.EACCES)
    assert_same(swapio.checkpoint.load(path), _state(1))


def test_without_a_process_group_a_save_is_refused_and_a_one_rank_checkpoint_loads(tmp_path):
    """Single-process use: save(distributed=True) needs a group (RuntimeError, nothing written); load of a
    directory one rank saved needs none (the world of a process without a group is 1)."""
    path = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        swapio.checkpoint.save(_state(1), path, distributed=True)
    assert not path.exists()
    with group_of_one(tmp_path / "store"):
        swapio.checkpoint.save(_state(1), path, distributed=True)
    assert_same(swapio.checkpoint.load(path), _state(1))
