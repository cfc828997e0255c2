"""A save whose write could not start (the submission's OSError: no space, a file replaced under the offload)
kept counting against staging_bytes for good: in a `with` around the training loop that caught the error and went
on, every later step had that much less room, and read back from the disk what it would have found in RAM."""
import pytest
import torch

from helpers.activations import swap_files
from swapio.offload import offload_activations

N = 256  # 256 KiB a saved storage


def step(x):
    """Three saved storages of 256 KiB (x * 2 for sin, exp's and tanh's outputs); the backward."""
    loss = (x * 2).sin().exp().tanh().sum()
    loss.backward()


def test_a_save_whose_write_could_not_start_gives_its_staging_room_back(tmp_path, monkeypatch):
    room = 3 * N * N * 4  # just the three storages of one step
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=room)
    x = torch.randn(N, N, requires_grad=True)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")
    with act:  # a `with` around the training loop
        with monkeypatch.context() as patch:
            patch.setattr(act._res.handle, "pwrite", no_space)
            with pytest.raises(OSError, match="No space left"):
                step(x)  # the loop catches it and goes on
        x.grad = None
        before = act.stats()["read_bytes"]
        step(x)
        assert act.stats()["read_bytes"] == before  # all three stayed in the staging room: nothing read back
    reference = x.detach().clone().requires_grad_(True)
    step(reference)
    assert torch.equal(x.grad, reference.grad)
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()
