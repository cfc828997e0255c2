"""accelerate's arguments that people pass to swapio's functions: preload_module_classes (modules that use a
submodule's weight directly get all their submodules' weights at their forward), cpu_offload(state_dict=...)
(the weights to offload instead of the model's own), and a clear error for a CUDA execution device without CUDA."""
import pytest
import torch

from swapio.offload import cpu_offload, cpu_offload_with_hook, disk_offload, remove_offload


class UsesChildWeight(torch.nn.Module):
    """Reads its child's weight directly (not by calling it), like attention blocks that fuse projections."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(x @ self.inner.weight.t() + self.inner.bias)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), UsesChildWeight(), UsesChildWeight(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("how", ["cpu", "disk"])
@pytest.mark.parametrize("spelling", ["name", "class"])
def test_preload_module_classes_fetches_submodule_weights_at_the_module(tmp_path, how, spelling):
    x = torch.randn(3, 8)
    want = model()(x)
    m = model()
    preload = ["UsesChildWeight"] if spelling == "name" else [UsesChildWeight]
    if how == "cpu":
        cpu_offload(m, preload_module_classes=preload)
    else:
        disk_offload(m, tmp_path / "od", preload_module_classes=preload, buffer_bytes=4096)
    for _ in range(2):
        assert torch.equal(m(x), want)
    assert m[1].inner.weight.device.type == "meta"  # streamed, not kept resident
    x.requires_grad_(True)  # backward through the preloaded weights too
    (grad,) = torch.autograd.grad(m(x).sum(), x)
    ref = x.detach().clone().requires_grad_(True)
    (want_grad,) = torch.autograd.grad(model()(ref).sum(), ref)
    assert torch.equal(grad, want_grad)
    remove_offload(m)


def test_without_preload_the_direct_read_fails(tmp_path):
    m = disk_offload(model(), tmp_path / "od")
    with pytest.raises((RuntimeError, NotImplementedError)):
        m(torch.randn(3, 8))


def test_preload_module_classes_of_a_wrong_type_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="preload_module_classes must hold class names"):
        cpu_offload(model(), preload_module_classes=[3])


def test_cpu_offload_state_dict_gives_the_weights_of_a_meta_model():
    x = torch.randn(3, 8)
    resident = model()
    with torch.device("meta"):
        m = model()
    cpu_offload(m, state_dict=resident.state_dict(), preload_module_classes=["UsesChildWeight"])
    assert torch.equal(m(x), resident(x))


def test_cpu_offload_state_dict_wins_over_the_models_weights():
    x = torch.randn(3, 8)
    source = model()
    for p in source.parameters():
        p.data.mul_(2)
    m = cpu_offload(model(), state_dict=source.state_dict(), preload_module_classes=["UsesChildWeight"])
    assert torch.equal(m(x), source(x))


def test_cpu_offload_state_dict_mistakes_are_clear_errors():
    state = model().state_dict()
    with pytest.raises(ValueError, match=r"name no parameter or buffer of the model, such as \['nope'\]"):
        cpu_offload(model(), state_dict=dict(state, nope=torch.zeros(1)))
    state["0.weight"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"state_dict\['0.weight'\] is torch.float32 \[4, 4\], the model's 0.weight"):
        cpu_offload(model(), state_dict=state)
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        cpu_offload(model(), state_dict=[1, 2])


@pytest.mark.parametrize("call", ["cpu_offload", "disk_offload", "cpu_offload_with_hook"])
def test_cuda_execution_device_without_cuda_is_a_clear_error(tmp_path, monkeypatch, call):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fn = {"cpu_offload": lambda m: cpu_offload(m, execution_device="cuda"),
          "disk_offload": lambda m: disk_offload(m, tmp_path / "od", execution_device="cuda"),
          "cpu_offload_with_hook": lambda m: cpu_offload_with_hook(m, execution_device="cuda:0")}[call]
    with pytest.raises(RuntimeError, match="execution_device='cuda.*' needs CUDA, but"):
        fn(model())
    assert not (tmp_path / "od").exists()  # reported before anything was written


@pytest.mark.parametrize("device", ["meta", "xpu"])
@pytest.mark.parametrize("call", ["cpu_offload", "disk_offload"])
def test_an_execution_device_that_cannot_compute_is_refused_at_once(tmp_path, call, device):
    fn = {"cpu_offload": lambda m: cpu_offload(m, execution_device=device),
          "disk_offload": lambda m: disk_offload(m, tmp_path / "od", execution_device=device)}[call]
    m = model()
    with pytest.raises(ValueError, match=f"not '{device}'"):
        fn(m)
    assert not (tmp_path / "od").exists()
    assert all(p.device.type == "cpu" for p in m.parameters())  # the model is as it was
