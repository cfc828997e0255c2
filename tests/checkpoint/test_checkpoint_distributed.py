"""torch.distributed (gloo, 2 processes on the loopback): save(..., distributed=True) writes one file per rank
and an index; each rank loads its own state back (also in place); the files are plain safetensors; loading on
another world size (here: this single process) is a ValueError saying resharding is out of scope; files of two
different saves are refused."""
import json
import os
import shutil

import pytest
import safetensors.torch as st
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import free_port  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2


def _state(rank, k):
    return {"model": {"w": torch.full((1000, 3), float(10 * k + rank)), "b": torch.arange(5) + rank},
            "optimizer": {"state": {0: {"step": torch.tensor(float(k))}}}, "rank": rank, "k": k}


def _worker(rank, port, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
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
    mp.start_processes(_worker, args=(free_port(), path), nprocs=WORLD, join=True, start_method="spawn")
    return path


def test_each_rank_writes_its_own_safetensors_file_and_an_index(sharded_dir):
    names = sorted(n for n in os.listdir(sharded_dir) if not n.startswith("."))
    assert names == ["rank-0.safetensors", "rank-1.safetensors", "swapio-checkpoint.json"]
    index = json.loads(open(os.path.join(sharded_dir, "swapio-checkpoint.json")).read())
    assert index["world_size"] == WORLD
    for r in range(WORLD):
        flat = st.load_file(os.path.join(sharded_dir, f"rank-{r}.safetensors"))
        assert torch.equal(flat["model.w"], torch.full((1000, 3), float(20 + r)))


def test_another_world_size_is_a_clear_error(sharded_dir):
    with pytest.raises(ValueError, match="saved by 2 ranks and this job has 1.*resharding.*out of scope"):
        swapio.checkpoint.load(sharded_dir)


def test_rank_files_of_two_different_saves_are_refused(sharded_dir, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(sharded_dir, mixed)
    index = json.loads((mixed / "swapio-checkpoint.json").read_text())
    index["world_size"] = 1
    (mixed / "swapio-checkpoint.json").write_text(json.dumps(index))
    shutil.copy(mixed / "rank-1.safetensors", mixed / "rank-0.safetensors")  # same save: still loads
    assert swapio.checkpoint.load(mixed)["rank"] == 1
    index["save_id"] = "another-save"
    (mixed / "swapio-checkpoint.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="another save.*interrupted"):
        swapio.checkpoint.load(mixed)
