"""Two jobs saving into one directory with save(..., distributed=True) at the same time: the second is refused
(OSError EBUSY, from rank 0's flock on the directory) and removes nothing; the first commits whole. Before, each
job's cleanup removed the other's rank files: the directory ended with an index naming a file the other job had
removed, and neither checkpoint loaded. The two jobs are one process here, each a group of one rank (gloo, a file
store), the second run inside the first at each point of its save, so the interleaving is deterministic."""
import errno
import json
import os
import stat

import pytest

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import INDEX, numbered_state as _state, one_rank  # noqa: F401 (a fixture)


def _while_saving(monkeypatch, obj, attr, other):
    """Runs other() once, right after obj.attr's first call in the next save."""
    real = getattr(obj, attr)

    def then_other(*args, **kwargs):
        result = real(*args, **kwargs)
        monkeypatch.setattr(obj, attr, real)
        other()
        return result
    monkeypatch.setattr(obj, attr, then_other)


def _points():
    from swapio.checkpoint import sharded_index
    from swapio.safetensors.file_writer import FileWriter
    return {"rank_file_published": (FileWriter, "commit"), "index_committed": (sharded_index, "commit"),
            "cleaning": (sharded_index, "remove_stale")}


@pytest.mark.parametrize("point", ["rank_file_published", "index_committed", "cleaning"])
def test_a_second_job_saving_into_the_directory_meanwhile_is_refused_and_removes_nothing(
        tmp_path, one_rank, monkeypatch, point):
    path = tmp_path / "ckpt"
    swapio.checkpoint.save(_state(1), path, distributed=True)
    seen = {}

    def other_job():
        try:
            swapio.checkpoint.save(_state(3), path, distributed=True)
            seen["other"] = "returned"
        except OSError as exc:
            seen["other"] = exc

    _while_saving(monkeypatch, *_points()[point], other_job)
    swapio.checkpoint.save(_state(2), path, distributed=True)
    assert isinstance(seen["other"], OSError) and seen["other"].errno == errno.EBUSY, seen
    assert "another live process" in str(seen["other"]) and "distributed checkpoint directory" in str(seen["other"])
    assert_same(swapio.checkpoint.load(path), _state(2))
    with open(path / INDEX) as f:
        assert sorted(os.listdir(path)) == sorted([INDEX, *json.load(f)["files"]])


def test_saves_one_after_the_other_take_the_lock_in_turn(tmp_path, one_rank):
    """The lock is released when a save returns, and when it fails."""
    path = tmp_path / "ckpt"
    swapio.checkpoint.save(_state(1), path, distributed=True)
    with pytest.raises(TypeError):
        swapio.checkpoint.save({"bad": {1, 2}}, path, distributed=True)
    swapio.checkpoint.save(_state(2), path, distributed=True)
    assert_same(swapio.checkpoint.load(path), _state(2))


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK", "EOPNOTSUPP"])
def test_a_file_system_without_flock_saves_unlocked(tmp_path, one_rank, monkeypatch, code):
    """Lustre mounted with noflock answers flock with ENOSYS, some NFS setups with ENOLCK: the save runs unlocked
    (one job per directory is then the caller's), rather than every distributed save failing there."""
    import fcntl
    path = tmp_path / "ckpt"
    swapio.checkpoint.save(_state(1), path, distributed=True)

    real = fcntl.flock

    def no_flock(fd, operation):  # on directories (the temporary files' locks are another matter)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(fd, operation)
    monkeypatch.setattr(fcntl, "flock", no_flock)
    swapio.checkpoint.save(_state(2), path, distributed=True)
    monkeypatch.undo()
    assert_same(swapio.checkpoint.load(path), _state(2))
