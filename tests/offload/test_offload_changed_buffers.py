"""An offloaded buffer that a module's forward changes (BatchNorm's running statistics in train mode, a cache a
module assigns again) would be read back unchanged at its next forward: that is refused with a RuntimeError
naming the buffer, after the forward cleaned up. Where the change is kept (buffers resident, the default;
cpu_offload computing on the CPU, whose host memory is the buffer itself), training equals the resident model."""
import copy

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.lin(self.bn(x))


class Counting(torch.nn.Module):
    """Assigns its buffer again in forward, as a growing rotary cache does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls = self.calls + 1
        return self.lin(x) + self.calls


def offloaders(tmp_path):
    return {"disk": lambda m, **kw: disk_offload(m, tmp_path / "od", **kw),
            "cpu": lambda m, **kw: cpu_offload(m, **kw)}


def test_running_statistics_changed_in_place_are_refused_where_they_would_be_lost(tmp_path):
    torch.manual_seed(0)
    reference, x = Normed(), torch.randn(4, 8)
    model = disk_offload(copy.deepcopy(reference), tmp_path / "od", offload_buffers=True)
    with pytest.raises(RuntimeError, match=r"bn\.running_mean.*offload_buffers=False"):
        model(x)
    model.eval()  # the statistics the model has are its own still: unchanged, and the model works
    assert torch.equal(model(x), reference.eval()(x))
    remove_offload(model)
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_a_buffer_assigned_again_in_forward_is_refused(tmp_path, how):
    torch.manual_seed(0)
    reference, x = Counting(), torch.randn(2, 4)
    model = offloaders(tmp_path)[how](copy.deepcopy(reference), offload_buffers=True)
    with pytest.raises(RuntimeError, match=r"calls.*assigned"):
        model(x)
    remove_offload(model)
    assert torch.equal(model.calls, reference.calls)  # unchanged: the refused forward's value is not kept


@pytest.mark.parametrize("how,offload_buffers", [("disk", False), ("cpu", False), ("cpu", True)])
def test_running_statistics_are_kept_where_the_buffer_stays_put(tmp_path, how, offload_buffers):
    torch.manual_seed(0)
    reference, x = Normed().train(), torch.randn(4, 8)
    model = offloaders(tmp_path)[how](copy.deepcopy(reference), offload_buffers=offload_buffers).train()
    for _ in range(3):
        assert torch.equal(model(x), reference(x))
    model.eval(), reference.eval()
    assert torch.equal(model(x), reference(x))
    remove_offload(model)
    for name, value in reference.bn.named_buffers():
        assert torch.equal(getattr(model.bn, name), value), name


def test_a_changed_buffer_under_a_preload_module_is_refused_too(tmp_path):
    torch.manual_seed(0)
    reference, x = torch.nn.Sequential(Normed()), torch.randn(4, 8)
    model = disk_offload(copy.deepcopy(reference), tmp_path / "od", offload_buffers=True,
                         preload_module_classes=["Normed"])
    with pytest.raises(RuntimeError, match=r"bn\.running_mean"):
        model(x)
    model.eval()  # every unit under the preload module was left: the model works
    assert torch.equal(model(x), reference.eval()(x))
