"""torch.distributed (gloo, 2 processes on the loopback): save(..., distributed=True) writes one file per rank
and an index; each rank loads its own state back (also in place); the files are plain safetensors; loading on
another world size (here: this single process) is a ValueError saying resharding is out of scope; a rank file of
another save is refused."""
import json
import os
import shutil

import pytest
import safetensors.torch as st
import torch
import torch.distributed as dist

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import init_group, run_group

pytestmark = pytest.mark.slow

WORLD = 2


def _state(rank, k):
    return {"model": {"w": torch.full((1000, 3), float(10 * k + rank)), "b": torch.arange(5) + rank},
            "optimizer": {"state": {0: {"step": torch.tensor(float(k))}}}, "rank": rank, "k": k}


def _worker(rank, port, path):
    init_group(rank, port, WORLD)
    try:
        swapio.checkpoint.save(_state(rank, 1), path, distributed=True)
        assert_same(swapio.checkpoint.load(path), _state(rank, 1))
        swapio.checkpoint.save(_state(rank, 2), path, distributed=True)  # over the first one
        out = _state(rank, 0)
        back = swapio.checkpoint.load(path, out=out)
        assert back["model"]["w"] is out["model"]["w"]
        assert_same(back, _state(rank, 2))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dist") / "ckpt")
    assert run_group(_worker, path, WORLD) == [0, 0]
    return path


def test_each_rank_writes_its_own_safetensors_file_and_an_index(sharded_dir):
    with open(os.path.join(sharded_dir, "swapio-checkpoint.json")) as f:
        index = json.load(f)
    assert index["world_size"] == WORLD and index["format_version"] == 2
    # each save's files under names of its own (its save id): the first save's were removed once the second committed
    assert index["files"] == [f"rank-{r}-{index['save_id']}.safetensors" for r in range(WORLD)]
    assert sorted(os.listdir(sharded_dir)) == sorted(["swapio-checkpoint.json", *index["files"]])
    for r in range(WORLD):
        flat = st.load_file(os.path.join(sharded_dir, index["files"][r]))
        assert torch.equal(flat["model.w"], torch.full((1000, 3), float(20 + r)))


def test_another_world_size_is_a_clear_error(sharded_dir):
    with pytest.raises(ValueError, match="saved by 2 ranks and this job has 1.*resharding.*out of scope"):
        swapio.checkpoint.load(sharded_dir)


def test_rank_files_of_two_different_saves_are_refused(sharded_dir, tmp_path):
    """A rank file copied in from another save, or from another rank, under the name the index gives is refused,
    not loaded as a mix; so is an index edited to another world size (its rank files say theirs)."""
    mixed = tmp_path / "mixed"
    shutil.copytree(sharded_dir, mixed)
    index = json.loads((mixed / "swapio-checkpoint.json").read_text())
    rank_1 = mixed / index["files"][1]
    index["world_size"], index["files"] = 1, index["files"][:1]
    (mixed / "swapio-checkpoint.json").write_text(json.dumps(index))
    # the index cut to one rank: rank 0's own file, of a save by 2 ranks, would load as the whole checkpoint
    with pytest.raises(ValueError, match="holds rank 0's state of a save by 2 ranks.*rank 0 of 1.*refused"):
        swapio.checkpoint.load(mixed)
    shutil.copy(rank_1, mixed / index["files"][0])  # the same save, another rank's state under rank 0's name
    with pytest.raises(ValueError, match="holds rank 1's state of a save by 2 ranks.*rank 0 of 1.*refused"):
        swapio.checkpoint.load(mixed)
    other = "0123456789abcdef"
    index["save_id"], index["files"] = other, [f"rank-0-{other}.safetensors"]
    (mixed / "swapio-checkpoint.json").write_text(json.dumps(index))
    shutil.copy(rank_1, mixed / index["files"][0])
    with pytest.raises(ValueError, match="another save.*a mix"):
        swapio.checkpoint.load(mixed)
