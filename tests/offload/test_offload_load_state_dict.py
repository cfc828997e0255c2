"""model.load_state_dict() of an offloaded model: a key naming an offloaded tensor is refused with torch's own
RuntimeError ("Error(s) in loading state_dict"), naming the key and what to do instead, where it used to copy
into the meta placeholder (a no-op behind a warning) or, with assign=True, be dropped at the next forward.
Keys of resident tensors load as on a resident model."""
import copy

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def shifted(model):
    """A state dict of other values for every tensor of the model."""
    return {k: v + 1 for k, v in model.state_dict().items()}


def offload(how, model, tmp_path, **kwargs):
    if how == "disk":
        return disk_offload(model, tmp_path / "od", **kwargs)
    return cpu_offload(model, **kwargs)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_loading_offloaded_weights_is_refused_and_changes_nothing_offloaded(tmp_path, how, assign):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict(.|\n)*0\.weight(.|\n)*offloaded"):
        model.load_state_dict(shifted(reference), assign=assign)
    with pytest.raises(RuntimeError, match=r"weight(.|\n)*offloaded"):  # on a submodule too
        model[2].load_state_dict(shifted(reference[2]), assign=assign)
    assert all(p.device.type == "meta" for p in model.parameters())  # the placeholders are still in place
    assert torch.equal(model(x), reference(x))
    remove_offload(model)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_keys_of_resident_tensors_load_as_on_a_resident_model(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path, keep_resident=["2"])
    head = {k: v for k, v in shifted(reference).items() if k.startswith("2.")}
    assert model.load_state_dict(head, strict=False).unexpected_keys == []
    reference.load_state_dict(head, strict=False)
    assert torch.equal(model(x), reference(x))
