"""save(..., distributed=True) when something goes wrong (gloo, 2 processes on the loopback): one rank raising
mid-save, one interrupted (KeyboardInterrupt) mid-save, one out of space (ENOSPC), rank 0 failing to write the index
or refused the directory another job is saving into (its lock held), a process group that is
a subset of the world, ranks saving different keys, dtypes and shapes under the same names, and a checkpoint of
format version 1 (earlier swapio) loaded and saved over. (A rank killed at each point of the save:
test_checkpoint_distributed_kill.py.) The reference is what each
rank saved, read back byte for byte by swapio and by safetensors' own loader per rank file. Each rank writes what
it saw to a JSON file; the processes are joined with a timeout and a collective times out in 10 s, so a rank left
waiting fails the test instead of hanging it."""
import json
import os

import pytest
import safetensors
import safetensors.torch as st
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import init_group, run_group

pytestmark = pytest.mark.slow

WORLD = 2
INDEX = "swapio-checkpoint.json"


def _state(rank, k):
    return {"w": torch.full((300, 3), float(10 * k + rank)), "b": torch.arange(5) + rank, "k": k, "rank": rank}


def _differing(rank):
    """The same names on both ranks with other dtypes and shapes, and a key only rank 1 has."""
    if rank == 0:
        return {"x": torch.arange(3, dtype=torch.float16).reshape(3, 1), "only": "rank 0"}
    return {"x": torch.arange(7, dtype=torch.int64), "y": (torch.arange(4.0).reshape(2, 2) / 3).to(torch.bfloat16), "only": "rank 1"}


def _error(exc):
    return f"{type(exc).__name__}: {exc}"


def _intact(path, rank, k):
    """Whether path loads as this rank's _state(rank, k), whole."""
    try:
        assert_same(swapio.checkpoint.load(path), _state(rank, k))
        return True
    except (AssertionError, ValueError) as exc:
        return _error(exc)


def _raises(rank, root, seen):
    path = os.path.join(root, "raises")
    swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
    bad = _state(rank, 2)
    if rank == 1:
        bad["extra"] = {1, 2}  # a TypeError on rank 1 only, once rank 0 has written its file
    try:
        swapio.checkpoint.save(bad, path, distributed=True)
        seen["raises"] = "returned"
    except (TypeError, RuntimeError) as exc:
        seen["raises"] = _error(exc)
    seen["raises_intact"] = _intact(path, rank, 1)


def _differing_keys(rank, root, seen):
    path = os.path.join(root, "differing")
    swapio.checkpoint.save(_differing(rank), path, distributed=True)
    assert_same(swapio.checkpoint.load(path), _differing(rank))
    seen["differing"] = True


def _metadata(rank, root, seen):
    path = os.path.join(root, "metadata")
    swapio.checkpoint.save(_state(rank, 1), path, distributed=True, metadata={"run": f"run of rank {rank}"})
    try:  # a key the sharded save writes itself: refused on every rank before any file changed
        swapio.checkpoint.save(_state(rank, 2), path, distributed=True, metadata={"swapio.save_id": "mine"})
        seen["metadata_reserved"] = "returned"
    except (ValueError, RuntimeError) as exc:
        seen["metadata_reserved"] = _error(exc)
    seen["metadata_intact"] = _intact(path, rank, 1)


def _subset(rank, root, seen):
    group = dist.new_group([1])  # a group without global rank 0 (its rank 0 is global rank 1)
    if rank == 1:
        path = os.path.join(root, "subset")
        swapio.checkpoint.save(_state(rank, 3), path, distributed=True, group=group)
        assert_same(swapio.checkpoint.load(path, group=group), _state(rank, 3))
        seen["subset"] = True


def _index_fails(rank, root, seen):
    path = os.path.join(root, "index")
    swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
    if rank == 0:  # the index's name taken by a non-empty directory: rank 0 cannot write it
        os.replace(os.path.join(path, "swapio-checkpoint.json"), os.path.join(root, "index-json"))
        os.makedirs(os.path.join(path, "swapio-checkpoint.json", "x"))
    try:
        swapio.checkpoint.save(_state(rank, 2), path, distributed=True)
        seen["index"] = "returned"
    except (OSError, RuntimeError) as exc:
        seen["index"] = _error(exc)
    dist.barrier()  # both ranks are still in step (no collective of the save left waiting)
    seen["after_index"] = True


def _listing(path):
    """(the directory's names, the index and the files it names): equal when nothing else is left there."""
    with open(os.path.join(path, INDEX)) as f:
        return sorted(os.listdir(path)), sorted([INDEX, *json.load(f)["files"]])


def _version_1(rank, root, seen):
    """A directory as an earlier swapio saved it (format version 1: rank-{r}.safetensors replaced in place, an index
    without format_version) loads, and a save over it leaves only its own files."""
    path = os.path.join(root, "version-1")
    os.makedirs(path, exist_ok=True)
    swapio.checkpoint.save(_state(rank, 1), os.path.join(path, f"rank-{rank}.safetensors"), metadata={
        "swapio.rank": str(rank), "swapio.world_size": str(WORLD), "swapio.save_id": "an-earlier-save"})
    dist.barrier()
    if rank == 0:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"format": "swapio.checkpoint.sharded", "world_size": WORLD, "save_id": "an-earlier-save",
                       "files": [f"rank-{r}.safetensors" for r in range(WORLD)]}, f)
    dist.barrier()
    seen["version_1_loads"] = _intact(path, rank, 1)
    swapio.checkpoint.save(_state(rank, 2), path, distributed=True)
    seen["version_1_saved_over"] = _intact(path, rank, 2)
    dist.barrier()
    seen["version_1_listing"] = _listing(path)


def _busy(rank, root, seen):
    """Another job's rank 0 holds the directory's lock (mid-save): this job's rank 0 is refused (EBUSY) before any
    rank writes, and rank 1 learns it from the broadcast of the save id at once."""
    import fcntl
    path = os.path.join(root, "busy")
    swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
    holder = None
    if rank == 0:
        holder = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        swapio.checkpoint.save(_state(rank, 2), path, distributed=True)
        seen["busy"] = "returned"
    except (OSError, RuntimeError) as exc:
        seen["busy"] = _error(exc)
    finally:
        if holder is not None:
            os.close(holder)
    seen["busy_intact"] = _intact(path, rank, 1)
    dist.barrier()
    seen["busy_listing"] = _listing(path)


def _enospc(rank, root, seen):
    """Rank 1's file system full while it writes (OSError ENOSPC from the writer)."""
    import errno
    from swapio.safetensors.file_writer import FileWriter
    path = os.path.join(root, "enospc")
    swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
    real = FileWriter.write

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    if rank == 1:
        FileWriter.write = full
    try:
        swapio.checkpoint.save(_state(rank, 2), path, distributed=True)
        seen["enospc"] = "returned"
    except (OSError, RuntimeError) as exc:
        seen["enospc"] = _error(exc)
    finally:
        FileWriter.write = real
    seen["enospc_intact"] = _intact(path, rank, 1)
    dist.barrier()
    seen["enospc_listing"] = _listing(path)


def _interrupt(where):
    """(object, attribute, replacement) that makes the save raise KeyboardInterrupt at `where`, as Ctrl-C would."""
    from swapio.core import _durable
    from swapio.safetensors.file_writer import FileWriter

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    def after_the_rename(*args, **kwargs):
        write_and_replace(*args, **kwargs)
        raise KeyboardInterrupt

    write_and_replace = _durable.write_and_replace
    return {"writing": (FileWriter, "write", interrupt),
            "index": (_durable, "write_and_replace", interrupt),
            "index_renamed": (_durable, "write_and_replace", after_the_rename)}[where]


INTERRUPTIONS = [("writing", 1, 1), ("index", 0, 1), ("index_renamed", 0, 2)]  # (where, the rank, what loads after)


def _interrupted(rank, root, seen):
    """One rank interrupted at each point in turn: it raises KeyboardInterrupt, the other a RuntimeError naming it
    (not gloo's timeout); the directory holds the previous checkpoint or the new one and nothing else."""
    for where, victim, loads in INTERRUPTIONS:
        path = os.path.join(root, f"interrupted-{where}")
        swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
        obj, attr, replacement = _interrupt(where)
        real = getattr(obj, attr)
        if rank == victim:
            setattr(obj, attr, replacement)
        try:
            swapio.checkpoint.save(_state(rank, 2), path, distributed=True)
            seen[f"interrupted_{where}"] = "returned"
        except (KeyboardInterrupt, RuntimeError) as exc:
            seen[f"interrupted_{where}"] = _error(exc)
        finally:
            setattr(obj, attr, real)
        seen[f"interrupted_{where}_loads"] = _intact(path, rank, loads)
        dist.barrier()
        seen[f"interrupted_{where}_listing"] = _listing(path)


def _failures_worker(rank, port, root):
    init_group(rank, port, WORLD)
    seen = {}
    try:
        for scenario in (_raises, _differing_keys, _metadata, _subset, _index_fails, _version_1, _busy, _enospc,
                         _interrupted):
            try:
                scenario(rank, root, seen)
            except Exception as exc:  # noqa: BLE001 - reported to the test of that scenario
                seen[scenario.__name__] = _error(exc)
    finally:
        with open(os.path.join(root, f"seen-{rank}.json"), "w") as f:
            json.dump(seen, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist-failures"))
    assert run_group(_failures_worker, root, WORLD) == [0, 0]
    return root, [json.load(open(os.path.join(root, f"seen-{r}.json"))) for r in range(WORLD)]


def _rank_file(path, rank):
    """The path of rank's file, as the index names it."""
    with open(os.path.join(path, INDEX)) as f:
        return os.path.join(path, json.load(f)["files"][rank])


def _rank_file_values(path, rank):
    """rank's file read by safetensors' own loader, and its save id."""
    file = _rank_file(path, rank)
    with safetensors.safe_open(file, "pt") as f:
        save_id = f.metadata()["swapio.save_id"]
    return st.load_file(file), save_id


def _ran(seen, scenario):
    """Every rank ran the scenario to its end (a crash of its own is recorded under "_<scenario>")."""
    assert f"_{scenario}" not in seen[0] and f"_{scenario}" not in seen[1], seen


def _kept_previous(seen, scenario):
    """Every rank found the previous checkpoint intact, and its directory holds only that checkpoint's files."""
    for r in range(WORLD):
        assert seen[r][f"{scenario}_intact"] is True
    listed, named = seen[0][f"{scenario}_listing"]
    assert listed == named


def test_one_rank_raising_leaves_the_previous_checkpoint_intact_on_every_rank(failures):
    root, seen = failures
    _ran(seen, "raises")
    assert seen[1]["raises"].startswith("TypeError: state['extra']: a set cannot be stored")
    assert seen[0]["raises"].startswith("RuntimeError: swapio.checkpoint: rank 1 failed to save its shard "
                                        "(TypeError: state['extra']")
    assert seen[0]["raises_intact"] is True and seen[1]["raises_intact"] is True
    path = os.path.join(root, "raises")
    index = json.load(open(os.path.join(path, "swapio-checkpoint.json")))
    for r in range(WORLD):
        flat, save_id = _rank_file_values(path, r)
        assert save_id == index["save_id"]
        assert torch.equal(flat["w"], _state(r, 1)["w"]) and torch.equal(flat["b"], _state(r, 1)["b"])
    assert sorted(os.listdir(path)) == sorted([INDEX, *index["files"]])  # rank 0 removed its file of the failed save


def test_ranks_save_different_keys_dtypes_and_shapes_under_the_same_names(failures):
    root, seen = failures
    assert seen[0].get("differing") is True and seen[1].get("differing") is True, seen
    for r in range(WORLD):
        flat, _ = _rank_file_values(os.path.join(root, "differing"), r)
        expected = {k: v for k, v in _differing(r).items() if isinstance(v, torch.Tensor)}
        assert flat.keys() == expected.keys()
        for k in expected:
            assert flat[k].dtype == expected[k].dtype and flat[k].shape == expected[k].shape
            assert torch.equal(flat[k], expected[k])


def test_metadata_reaches_every_rank_file_and_its_own_keys_are_refused(failures):
    root, seen = failures
    _ran(seen, "metadata")
    for r in range(WORLD):
        with safetensors.safe_open(_rank_file(os.path.join(root, "metadata"), r), "pt") as f:
            assert f.metadata()["run"] == f"run of rank {r}"
        assert seen[r]["metadata_reserved"].startswith("ValueError: metadata key 'swapio.save_id' is reserved")
        assert seen[r]["metadata_intact"] is True


def test_a_group_without_global_rank_0_saves_and_loads(failures):
    root, seen = failures
    assert seen[1].get("subset") is True, seen[1]
    index = json.load(open(os.path.join(root, "subset", "swapio-checkpoint.json")))
    assert index["world_size"] == 1
    flat, _ = _rank_file_values(os.path.join(root, "subset"), 0)  # rank 0 of the group: global rank 1
    assert torch.equal(flat["w"], _state(1, 3)["w"])


def test_rank_0_failing_to_write_the_index_fails_every_rank(failures):
    _, seen = failures
    _ran(seen, "index_fails")
    assert seen[0]["index"].startswith("IsADirectoryError")
    assert seen[1]["index"].startswith("RuntimeError: swapio.checkpoint: rank 0 failed to write the index")
    assert seen[0]["after_index"] is True and seen[1]["after_index"] is True


def test_a_checkpoint_of_format_version_1_loads_and_a_save_over_it_leaves_only_its_own_files(failures):
    _, seen = failures
    _ran(seen, "version_1")
    for r in range(WORLD):
        assert seen[r]["version_1_loads"] is True and seen[r]["version_1_saved_over"] is True
    listed, named = seen[0]["version_1_listing"]
    assert listed == named and "rank-0.safetensors" not in listed


@pytest.mark.parametrize("where, victim, loads", INTERRUPTIONS, ids=[w for w, _, _ in INTERRUPTIONS])
def test_a_rank_interrupted_mid_save_tells_the_others_which_raise_naming_it(failures, where, victim, loads):
    """Ctrl-C on one rank: it raises KeyboardInterrupt; the others learn it in the save's next agreement and raise
    a RuntimeError naming that rank, instead of waiting out the process group's timeout (gloo's error then)."""
    _, seen = failures
    _ran(seen, "interrupted")
    assert seen[victim][f"interrupted_{where}"].startswith("KeyboardInterrupt")
    failed = "failed to save its shard" if where == "writing" else "failed to write the index"
    assert seen[1 - victim][f"interrupted_{where}"].startswith(
        f"RuntimeError: swapio.checkpoint: rank {victim} {failed} (KeyboardInterrupt)")
    for r in range(WORLD):
        assert seen[r][f"interrupted_{where}_loads"] is True, seen[r]
    listed, named = seen[0][f"interrupted_{where}_listing"]
    assert listed == named  # the files of the interrupted save were removed, or (committed) the previous ones


def test_a_directory_another_job_is_saving_into_is_refused_on_every_rank_before_any_write(failures):
    _, seen = failures
    _ran(seen, "busy")
    assert seen[0]["busy"].startswith("OSError: [Errno 16] another live process (or another save or load of this one) "
                                      "is using this distributed checkpoint")
    assert seen[1]["busy"].startswith("RuntimeError: swapio.checkpoint: rank 0 failed to start the save (OSError: "
                                      "[Errno 16]")
    _kept_previous(seen, "busy")


def test_enospc_on_one_rank_fails_every_rank_naming_it_and_keeps_the_previous_checkpoint(failures):
    _, seen = failures
    _ran(seen, "enospc")
    assert seen[1]["enospc"].startswith("OSError: [Errno 28]")
    assert seen[0]["enospc"].startswith("RuntimeError: swapio.checkpoint: rank 1 failed to save its shard (OSError: "
                                        "[Errno 28] No space left on device)")
    _kept_previous(seen, "enospc")
