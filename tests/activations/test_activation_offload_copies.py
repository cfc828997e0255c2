"""Copies of a model with activation offload switched on (copy.deepcopy for an EMA model, torch.save of the model
object, pickle), and of an ActivationOffload: a TypeError that says what to do, not pickle's complaint about a
lock; the model copied after disable_activation_offload, then switched on again, trains as before."""
import copy
import io
import pickle

import pytest
import torch

from swapio.offload import disable_activation_offload, enable_activation_offload, offload_activations

COPIES = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps,
          "torch.save": lambda obj: torch.save(obj, io.BytesIO())}


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])  # (copy.copy of a module shares its forward)
def test_copying_a_model_with_the_switch_on_says_what_to_do(tmp_path, how):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    enable_activation_offload(model, to="nvme", swap_dir=tmp_path)
    with pytest.raises(TypeError, match="disable_activation_offload"):
        COPIES[how](model)
    disable_activation_offload(model)
    twin = copy.deepcopy(model)
    enable_activation_offload(twin, to="nvme", swap_dir=tmp_path, min_bytes=0)
    x = torch.randn(4, 8, requires_grad=True)
    want = torch.autograd.grad(model(x).sum(), x)[0]
    assert torch.equal(torch.autograd.grad(twin(x).sum(), x)[0], want)
    disable_activation_offload(twin)


@pytest.mark.parametrize("how", list(COPIES))
def test_copying_an_activation_offload_says_what_to_do(tmp_path, how):
    act = offload_activations(to="nvme", swap_dir=tmp_path)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        COPIES[how](act)
    act.close()
