"""A model offloaded from a checkpoint (read in place for its whole life) whose file is replaced at its name (another
job saving there, a save_pretrained into the same directory): the reads refuse the new file (OSError ESTALE naming
it) instead of reading it at the old header's offsets, where the model computed with other tensors' bytes, silently."""
import errno
import os

import pytest
import torch

import swapio
from swapio.offload import disk_offload, remove_offload


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))


def offloaded_from(path):
    with torch.device("meta"):
        model = build()
    return disk_offload(model, checkpoint=str(path), prefetch=0, buffer_bytes=1 << 20)


def test_a_replaced_checkpoint_file_is_refused_not_read_at_the_old_offsets(tmp_path):
    path = tmp_path / "model.safetensors"
    reference = build()
    swapio.checkpoint.save(reference.state_dict(), path)
    x = torch.randn(2, 256)
    model = offloaded_from(path)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        other = {k: v * 3 for k, v in reference.state_dict().items()}
        swapio.checkpoint.save({k: other[k] for k in ("1.bias", "1.weight", "0.bias", "0.weight")}, path)
        with pytest.raises(OSError) as info:
            model(x)
    assert info.value.errno == errno.ESTALE
    assert info.value.filename == str(path)
    with pytest.raises(OSError):  # nor are the weights brought back from it
        remove_offload(model)


def test_a_checkpoint_behind_a_link_is_read_through_it(tmp_path):
    reference = build()
    swapio.checkpoint.save(reference.state_dict(), tmp_path / "blob")
    os.symlink("blob", tmp_path / "model.safetensors")  # as the Hugging Face cache links a snapshot's files
    x = torch.randn(2, 256)
    model = offloaded_from(tmp_path / "model.safetensors")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    remove_offload(model)
