"""A path ending in a slash names a directory, as open() and torch.save read it: checkpoint.save and async_save
wrote the file without the slash ("ck/" wrote, or replaced, the file "ck"); save_checkpoint, which writes a
directory for a directory, wrote one file there too."""
import os

import pytest
import torch

swapio = pytest.importorskip("swapio")


def _save(path):
    swapio.checkpoint.save({"t": torch.ones(3)}, path)


def _async_save(path):
    swapio.checkpoint.async_save({"t": torch.ones(3)}, path).wait(timeout=60)


@pytest.mark.parametrize("save", [_save, _async_save], ids=["save", "async_save"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "over an existing file"])
def test_checkpoint_save_refuses_a_path_ending_in_a_slash(tmp_path, save, existing):
    before = b"the user's file"
    if existing:
        (tmp_path / "ck").write_bytes(before)
    with pytest.raises(IsADirectoryError, match="ends in a slash"):
        save(str(tmp_path / "ck") + os.sep)
    assert os.listdir(tmp_path) == (["ck"] if existing else [])  # nothing written, no temporary file left
    if existing:
        assert (tmp_path / "ck").read_bytes() == before


def test_save_checkpoint_writes_a_directory_for_a_path_ending_in_a_slash(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    written = swapio.offload.save_checkpoint(model, str(tmp_path / "out") + os.sep)
    assert written == str(tmp_path / "out" / "model.safetensors.index.json")
    loaded = swapio.offload.load_file(tmp_path / "out")
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
