"""remove_offload gives the weights back in the layout they were offloaded in: a channels_last convolution's
weights came back contiguous (equal values, another layout: the resident model's kernels then took other paths)."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload


def convs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 4, 3))
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().transpose(2, 3).contiguous().transpose(2, 3))
    return model.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_remove_offload_gives_back_each_weights_layout(tmp_path, offload):
    model = convs()
    before = {name: (t.detach().clone(memory_format=torch.preserve_format), t.stride())
              for name, t in model.state_dict().items()}
    assert model[0].weight.stride() != model[0].weight.contiguous().stride()  # (the test's premise)
    if offload == "cpu":
        cpu_offload(model)
    else:
        disk_offload(model, offload_dir=tmp_path)
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last)
    model(x)
    remove_offload(model)
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name][0]), name
        assert t.stride() == before[name][1], name
    assert torch.equal(model(x), convs()(x))
