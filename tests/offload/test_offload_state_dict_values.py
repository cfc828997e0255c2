"""state_dict() of an offloaded model: names, shapes and dtypes as the resident model's; the offloaded weights'
values refused with a RuntimeError naming the weight and what saves an offloaded model (save_checkpoint,
opt.save), by torch.save (which wrote meta tensors without a word), safetensors and every copy (torch's
"Cannot copy out of meta tensor" before). keep_vars=True, the swapio export that reads it, and resident tensors
are unchanged."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint

SAVES = "save_checkpoint(.|\n)*opt.save"


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


OFFLOADS = {"disk": lambda net, tmp: disk_offload(net, offload_dir=tmp / "od"), "cpu": lambda net, tmp: cpu_offload(net)}


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_state_dict_keeps_metadata_and_refuses_values(kind, tmp_path):
    resident = _net().state_dict()
    net = OFFLOADS[kind](_net(), tmp_path)
    net(torch.randn(2, 8))  # after a forward too
    sd = net.state_dict()
    assert list(sd) == list(resident)
    assert [(v.shape, v.dtype, v.numel()) for v in sd.values()] == [
        (v.shape, v.dtype, v.numel()) for v in resident.values()]
    assert "meta" in repr(sd["0.weight"])
    for use in (lambda t: t.to("cpu"), lambda t: t.cpu(), lambda t: t.numpy(), lambda t: t.tolist(),
                lambda t: torch.empty(t.shape).copy_(t), lambda t: t + 1, lambda t: t.clone(),
                lambda t: torch.save(t, str(tmp_path / "t.pt")), lambda t: torch.save({"w": t}, str(tmp_path / "d.pt"))):
        with pytest.raises(RuntimeError, match="0.weight is offloaded by swapio(.|\n)*" + SAVES):
            use(sd["0.weight"])
    with pytest.raises(RuntimeError, match="2.bias is offloaded by swapio"):
        net[2].state_dict()["bias"].cpu()  # a submodule's state_dict, named by the model's name for it
    assert all(isinstance(v, torch.nn.Parameter) and v.is_meta for v in net.state_dict(keep_vars=True).values())
    save_checkpoint(net, str(tmp_path / "w.safetensors"))  # swapio's export, which reads keep_vars=True
    from safetensors.torch import load_file
    assert all(torch.equal(load_file(tmp_path / "w.safetensors")[k], v) for k, v in resident.items())
    remove_offload(net)
    for k, v in net.state_dict().items():
        assert type(v) is torch.Tensor and torch.equal(v, resident[k])


def test_resident_tensors_of_an_offloaded_model_keep_their_values(tmp_path):
    resident = _net().state_dict()
    net = disk_offload(_net(), offload_dir=tmp_path / "od", keep_resident=["2"])
    sd = net.state_dict()
    assert type(sd["2.weight"]) is torch.Tensor and torch.equal(sd["2.weight"], resident["2.weight"])
    with pytest.raises(RuntimeError, match="0.weight is offloaded by swapio"):
        torch.save(sd, str(tmp_path / "all.pt"))


def test_safetensors_save_file_of_a_transformers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    disk_offload(gpt, offload_dir=tmp_path / "od")
    with pytest.raises(RuntimeError, match="is offloaded by swapio(.|\n)*" + SAVES):
        safetensors_torch.save_file(gpt.state_dict(), str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_state_dict_of_a_model_just_wrapped_refuses_the_stand_ins(kind, tmp_path):
    """A model put under a module outside it (peft's get_peft_model) shows stand-ins until its next forward (one
    expanded NaN element, not on meta): state_dict() gave them as values, and torch.save wrote NaN weights."""
    resident = _net().state_dict()
    net = OFFLOADS[kind](_net(), tmp_path)
    outer = torch.nn.Module()
    outer.inner = net
    assert net[0].weight.device.type == "cpu"  # a stand-in
    sd = outer.state_dict()
    assert [(k, v.shape, v.dtype) for k, v in sd.items()] == [
        ("inner." + k, v.shape, v.dtype) for k, v in resident.items()]
    with pytest.raises(RuntimeError, match="0.weight is offloaded by swapio(.|\n)*" + SAVES):
        torch.save(sd, str(tmp_path / "all.pt"))
    with pytest.raises(RuntimeError, match="2.bias is offloaded by swapio"):
        sd["inner.2.bias"].clone()
    assert all(isinstance(v, torch.nn.Parameter) for v in outer.state_dict(keep_vars=True).values())


@pytest.mark.parametrize("call", ["cpu_offload", "dispatch_model"])
def test_accelerate_offloading_an_offloaded_model_says_it_is_offloaded(tmp_path, call):
    """accelerate's cpu_offload and dispatch_model (with disk entries) read state_dict() values first: the error
    said only what saves a model; it now says the model is offloaded already. The model is left working."""
    accelerate = pytest.importorskip("accelerate")
    x = torch.randn(2, 8)
    want = _net()(x)
    net = cpu_offload(_net())
    with pytest.raises(RuntimeError, match=r"0.weight is offloaded by swapio(.|\n)*dispatch_model read these values "
                                           r"too: the model is offloaded already"):
        if call == "cpu_offload":
            accelerate.cpu_offload(net, execution_device="cpu")
        else:
            accelerate.dispatch_model(net, device_map={"0": "disk", "1": "cpu", "2": "cpu"}, offload_dir=tmp_path)
    assert not any(hasattr(m, "_hf_hook") for m in net.modules())
    assert torch.equal(net(x), want)
