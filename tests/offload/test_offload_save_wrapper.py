"""save_checkpoint of a module of the user's own that holds an offloaded model (a backbone and a new head). Before
the model's first forward it wrote the stand-ins swapio shows until then (NaN) as the backbone's weights, without a
word; after it, it said the weights were "on the meta device and not offloaded by swapio". Now it writes what the
resident module holds, bit for bit; a module holding two offloaded models is a ValueError saying to save each."""
import pytest
import torch

from helpers.offload_training import WithHead
from swapio.offload import cpu_offload, disk_offload, save_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")


def backbone():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def offload(how, model, directory):
    return disk_offload(model, directory) if how == "disk" else cpu_offload(model)


@pytest.mark.parametrize("forward_first", [False, True], ids=["before-forward", "after-forward"])
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_saving_a_module_holding_an_offloaded_model_writes_its_values(tmp_path, how, forward_first):
    reference = WithHead(backbone(), (3, 2))
    model = WithHead(offload(how, backbone(), tmp_path / "od"), (3, 2))
    if forward_first:
        assert torch.equal(model(torch.ones(2, 4)), reference(torch.ones(2, 4)))
    save_checkpoint(model, tmp_path / "w.safetensors")
    saved = safetensors_torch.load_file(str(tmp_path / "w.safetensors"))
    assert saved.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_a_module_holding_two_offloaded_models_is_refused(tmp_path):
    both = torch.nn.ModuleDict({"a": offload("disk", backbone(), tmp_path / "a"), "b": cpu_offload(backbone())})
    with pytest.raises(ValueError, match=r"holds 2 models offloaded by swapio: save each of them"):
        save_checkpoint(both, tmp_path / "t.safetensors")
    assert not (tmp_path / "t.safetensors").exists()
