"""save(..., distributed=True) when something goes wrong (gloo, 2 processes on the loopback): one rank raising
mid-save, a rank killed (SIGKILL) mid-save, rank 0 failing to write the index, a process group that is a subset
of the world, and ranks saving different keys, dtypes and shapes under the same names. The reference is what each
rank saved, read back byte for byte by swapio and by safetensors' own loader per rank file. Each rank writes what
it saw to a JSON file; the processes are joined with a timeout and a collective times out in 10 s, so a rank left
waiting fails the test instead of hanging it."""
import datetime
import json
import os
import signal

import pytest
import safetensors
import safetensors.torch as st
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import free_port  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
JOIN_TIMEOUT = 60


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


def _init(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=10))


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


def _failures_worker(rank, port, root):
    _init(rank, port)
    seen = {}
    try:
        for scenario in (_raises, _differing_keys, _metadata, _subset, _index_fails):  # (one left out of step: the last)
            try:
                scenario(rank, root, seen)
            except Exception as exc:  # noqa: BLE001 - reported to the test of that scenario
                seen[scenario.__name__] = _error(exc)
    finally:
        with open(os.path.join(root, f"seen-{rank}.json"), "w") as f:
            json.dump(seen, f)
        dist.destroy_process_group()


def _killed_worker(rank, port, path):
    _init(rank, port)
    seen = {}
    try:
        swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
        if rank == 1:  # dies while writing its file of the second save, when rank 0 may have written its own
            import swapio.safetensors.file_writer as file_writer
            file_writer.FileWriter.write = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        try:
            swapio.checkpoint.save(_state(rank, 2), path, distributed=True)
            seen["save"] = "returned"
        except RuntimeError as exc:
            seen["save"] = _error(exc)
    finally:
        with open(f"{path}-seen-{rank}.json", "w") as f:
            json.dump(seen, f)


def _run(worker, arg):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, arg)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, "a rank hung"
    return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist-failures"))
    _run(_failures_worker, root)
    return root, [json.load(open(os.path.join(root, f"seen-{r}.json"))) for r in range(WORLD)]


def _rank_file_values(path, rank):
    """rank-{rank}.safetensors read by safetensors' own loader, and its save id."""
    file = os.path.join(path, f"rank-{rank}.safetensors")
    with safetensors.safe_open(file, "pt") as f:
        save_id = f.metadata()["swapio.save_id"]
    return st.load_file(file), save_id


def test_one_rank_raising_leaves_the_previous_checkpoint_intact_on_every_rank(failures):
    root, seen = failures
    assert "_raises" not in seen[0] and "_raises" not in seen[1], seen
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
    assert sorted(os.listdir(path)) == ["rank-0.safetensors", "rank-1.safetensors", "swapio-checkpoint.json"]


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
    assert "_metadata" not in seen[0] and "_metadata" not in seen[1], seen
    for r in range(WORLD):
        with safetensors.safe_open(os.path.join(root, "metadata", f"rank-{r}.safetensors"), "pt") as f:
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
    assert "_index_fails" not in seen[0] and "_index_fails" not in seen[1], seen
    assert seen[0]["index"].startswith("IsADirectoryError")
    assert seen[1]["index"].startswith("RuntimeError: swapio.checkpoint: rank 0 failed to write the index")
    assert seen[0]["after_index"] is True and seen[1]["after_index"] is True


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = str(tmp_path / "ckpt")
    assert _run(_killed_worker, path) == [0, -signal.SIGKILL]
    seen = json.load(open(f"{path}-seen-0.json"))
    assert seen["save"].startswith("RuntimeError")  # gloo's: the peer closed the connection
    index = json.load(open(os.path.join(path, "swapio-checkpoint.json")))
    for r in range(WORLD):
        flat, save_id = _rank_file_values(path, r)
        assert save_id == index["save_id"]
        assert torch.equal(flat["w"], _state(r, 1)["w"])
    # rank 0 removed its temporary file; rank 1's (killed) is reclaimed by the next save into the directory
    assert not [n for n in os.listdir(path) if n.startswith(".rank-0")]
