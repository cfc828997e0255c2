"""model.share_memory() of an offloaded model was a silent no-op for its offloaded weights: Hogwild training
(torch.multiprocessing, a forked child training the shared model) changed the child's copy of cpu_offload's host
memory, and the parent went on with its old weights, where the resident model's parent sees the child's updates.
It is a RuntimeError naming the weight and what to do, before any tensor changed (resident buffers included); the
model works on, and after remove_offload share_memory() shares as usual."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)).eval()


def offload(how, model, tmp_path, **kwargs):
    return disk_offload(model, tmp_path / "od", **kwargs) if how == "disk" else cpu_offload(model, **kwargs)


@pytest.mark.parametrize("share", ["model", "submodule"])
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_share_memory_is_refused_before_anything_changed(tmp_path, how, share):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, net(), tmp_path)
    with pytest.raises(RuntimeError, match=r"share_memory\(\) of a model offloaded by swapio cannot share its "
                                           r"offloaded weights \((0|2)\.weight.*Hogwild.*remove_offload\(model\)"):
        model.share_memory() if share == "model" else model[2].share_memory()
    assert not any(b.is_shared() for b in model.buffers())  # the resident ones are left as they were
    assert torch.equal(model(x), reference(x))
    remove_offload(model)
    model.share_memory()
    assert all(t.is_shared() for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(model(x), reference(x))


def test_share_memory_of_a_resident_part_goes_ahead(tmp_path):
    """A module holding no offloaded tensor (keep_resident) shares as torch does."""
    reference, x = net(), torch.randn(2, 4)
    model = offload("cpu", net(), tmp_path, keep_resident=["2"])
    model[2].share_memory()
    assert all(p.is_shared() for p in model[2].parameters())
    assert torch.equal(model(x), reference(x))
