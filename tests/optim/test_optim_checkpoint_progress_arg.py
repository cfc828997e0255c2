"""opt.save/load's `progress=`: None, True or False (numpy's bool too), as disk_offload takes it. 1 or "yes" were
taken (any truthy value drew the bar); they are now the TypeError disk_offload gives, before anything is written or
read."""
import numpy as np
import pytest
import torch

from helpers.optim import stepped_cpu_adamw


@pytest.mark.parametrize("progress", [1, 0, "yes", 1.0])
def test_a_progress_that_is_not_a_bool_is_refused_before_any_work(progress, tmp_path):
    opt = stepped_cpu_adamw(64)
    with pytest.raises(TypeError, match="progress must be None, True or False"):
        opt.save(tmp_path / "new", progress=progress)
    assert not (tmp_path / "new").exists()
    opt.save(tmp_path / "ckpt")
    before = {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)} for k, s in opt.state.items()}
    with pytest.raises(TypeError, match="progress must be None, True or False"):
        opt.load(tmp_path / "ckpt", progress=progress)
    assert all(torch.equal(opt.state[k][n], v) for k, s in before.items() for n, v in s.items())


@pytest.mark.parametrize("progress", [None, False, np.False_])
def test_the_bools_are_taken(progress, tmp_path):
    opt = stepped_cpu_adamw(64)
    opt.save(tmp_path / "ckpt", progress=progress)
    opt.load(tmp_path / "ckpt", progress=progress)
