"""Saved tensors that offload_activations leaves in place: nested tensors (strided and jagged) come back as they
were saved, their gradients bit-equal to the run without offload."""
import warnings

import pytest
import torch

from swapio.offload import offload_activations


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_tensors_are_left_in_place_and_gradients_stay_equal(tmp_path, layout):
    def loss(parts):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # nested tensors' "prototype stage" warning
            nested = torch.nested.as_nested_tensor(parts, layout=layout)
        y = (nested * 2).sin() * nested
        return torch.cat([t.reshape(-1) for t in y.unbind()]).sum()

    parts = [torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)]
    want = torch.autograd.grad(loss(parts), parts)
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0)
    with act:
        got = loss(parts)
    for g, w in zip(torch.autograd.grad(got, parts), want):
        assert torch.equal(g, w)
    act.close()
