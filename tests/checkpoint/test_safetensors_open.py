"""swapio.safetensors.open_checkpoint: one parse of each header gives the tensors, files, weight map and metadata
(checked against the safetensors library), and a load reads each header once."""
import builtins
import json
import os

import pytest
import safetensors
import safetensors.torch as st
import torch

import swapio
from swapio.safetensors import open_checkpoint


@pytest.fixture
def opens(monkeypatch):
    """{path: how many times open() was called on it} from here on (headers and indexes are read with open();
    tensor bytes go through the native handle)."""
    counts = {}
    real = builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            key = os.path.abspath(os.fspath(file))
            counts[key] = counts.get(key, 0) + 1
        return real(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", counting)
    return counts


def test_open_checkpoint_agrees_with_safe_open_on_one_file(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = {"b": torch.arange(5, dtype=torch.int32), "a": torch.randn(3, 4).bfloat16()}
    st.save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    ckpt = open_checkpoint(path)
    with safetensors.safe_open(str(path), "pt") as f:
        assert sorted(ckpt) == sorted(f.keys())
        assert ckpt.metadata == f.metadata()
        for name in f.keys():
            t = f.get_tensor(name)
            assert (ckpt[name].dtype, ckpt[name].shape) == (t.dtype, tuple(t.shape))
    assert ckpt.files == [str(path)] and ckpt.weight_map is None


def test_open_checkpoint_of_a_sharded_index_names_its_files_and_has_no_single_metadata(tmp_path):
    st.save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"), metadata={"format": "pt"})
    st.save_file({"b": torch.zeros(3)}, str(tmp_path / "s2.safetensors"), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.files == [str(tmp_path / "s1.safetensors"), str(tmp_path / "s2.safetensors")]
    assert ckpt.weight_map == {"a": str(tmp_path / "s1.safetensors"), "b": str(tmp_path / "s2.safetensors")}
    assert ckpt.metadata == {}  # (the metadata of one file of several is not the checkpoint's)
    assert ckpt["b"].path == str(tmp_path / "s2.safetensors") and ckpt["b"].shape == (3,)


def test_load_reads_the_header_of_the_file_once(tmp_path, opens):
    path = tmp_path / "c.safetensors"
    state = {"model": {"w": torch.randn(100)}, "step": 3}
    swapio.checkpoint.save(state, path)
    opens.clear()
    back = swapio.checkpoint.load(path)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 3
    assert opens.get(str(path)) == 1


def test_a_sharded_load_reads_the_header_of_its_rank_file_once(tmp_path, opens):
    """A directory that save(distributed=True) writes, for a world of one rank (no process group: rank 0 of 1)."""
    directory = tmp_path / "sharded"
    directory.mkdir()
    rank_file = directory / "rank-0.safetensors"
    swapio.checkpoint.save({"w": torch.arange(10.0)}, rank_file,
                           metadata={"swapio.rank": "0", "swapio.world_size": "1", "swapio.save_id": "s1"})
    (directory / "swapio-checkpoint.json").write_text(json.dumps(
        {"format": "swapio.checkpoint.sharded", "world_size": 1, "save_id": "s1", "files": ["rank-0.safetensors"]}))
    opens.clear()
    assert torch.equal(swapio.checkpoint.load(directory)["w"], torch.arange(10.0))
    assert opens.get(str(rank_file)) == 1


@pytest.mark.slow
def test_from_pretrained_reads_the_header_of_the_checkpoint_once(tmp_path, opens):
    """It reads the stored dtype and offloads from the same parse (it parsed the header twice)."""
    from helpers import hf_tiny
    from swapio.offload import from_pretrained
    hf_tiny.save("llama", tmp_path)
    opens.clear()
    model = from_pretrained(hf_tiny.arch("llama")[1], tmp_path)
    assert opens.get(str(tmp_path / "model.safetensors")) == 1
    reference = hf_tiny.arch("llama")[1].from_pretrained(tmp_path).eval()
    got, want = hf_tiny.run(model), hf_tiny.run(reference)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
