"""An offloaded submodule replaced by a new module after offloading (`model.head = nn.Linear(...)`, a new
classifier for fine-tuning). The model computes with the new module, as the resident model does, but
save_checkpoint (and save_pretrained) wrote the old module's stored weights under its name instead of the new
module's, without a word; and once the old module was collected, save_checkpoint and remove_offload failed with
"'NoneType' object has no attribute '_parameters'". Now both give what the resident model with the same
replacement holds, bit for bit, and training the new module goes as on the resident model."""
import gc

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint
from swapio.optim import OffloadAdamW

safetensors_torch = pytest.importorskip("safetensors.torch")


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def replace_head(model):
    torch.manual_seed(5)
    model[2] = torch.nn.Linear(8, 3)


def offload(how, model, tmp_path):
    return disk_offload(model, tmp_path / "od") if how == "disk" else cpu_offload(model)


@pytest.mark.parametrize("old_kept", [False, True], ids=["old-collected", "old-kept"])
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_replaced_module_is_saved_trained_and_removed_as_resident(tmp_path, how, old_kept):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, net(), tmp_path)
    old = model[2]
    replace_head(reference)
    replace_head(model)
    if not old_kept:
        del old
        gc.collect()
    assert torch.equal(model(x), reference(x))
    save_checkpoint(model, tmp_path / "a.safetensors")
    saved = safetensors_torch.load_file(str(tmp_path / "a.safetensors"))
    assert saved.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(saved[name], value), name
    for m in (reference, model):
        with OffloadAdamW(m.parameters(), lr=0.1) as opt:
            for _ in range(2):
                m(x).sum().backward()
                opt.step()
                opt.zero_grad()
    assert torch.equal(model(x), reference(x))
    remove_offload(model)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        assert not p.is_meta and torch.equal(p, r), name
    assert torch.equal(model(x), reference(x))
