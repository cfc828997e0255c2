"""Bad input to swapio.offload: clear exceptions before any forward runs, and nothing partial left on disk."""
import json
import os
import struct

import pytest
import torch

from swapio.offload import cpu_offload, cpu_offload_with_hook, disk_offload, remove_offload
from swapio.offload.api import _offloaded
from helpers.offload import assert_same_outputs, meta_model, resident_model

safetensors_torch = pytest.importorskip("safetensors.torch")


def checkpoint(tmp_path, mutate=None, name="w.safetensors"):
    """A safetensors file of the tiny GPT-2, optionally with its state dict changed first."""
    sd = {k: v.clone() for k, v in resident_model().state_dict().items() if k != "lm_head.weight"}
    if mutate is not None:
        mutate(sd)
    path = tmp_path / name
    safetensors_torch.save_file(sd, str(path))
    return path


def test_offload_dir_or_checkpoint_is_needed(tmp_path):
    with pytest.raises(ValueError, match="needs offload_dir .* or checkpoint"):
        disk_offload(resident_model())


def test_bad_arguments_are_type_and_value_errors(tmp_path):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        disk_offload("model", tmp_path / "od")
    with pytest.raises(ValueError, match="prefetch"):
        cpu_offload(resident_model(), prefetch=-1)
    with pytest.raises(ValueError, match="buffer_bytes"):
        disk_offload(resident_model(), tmp_path / "od", buffer_bytes=10)
    with pytest.raises(ValueError, match="keep_resident names 'nope'"):
        disk_offload(resident_model(), tmp_path / "od", keep_resident=["nope"])
    assert not (tmp_path / "od").exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda sd: sd.pop("transformer.h.1.mlp.c_fc.weight"), r"lacks tensor 'transformer.h.1.mlp.c_fc.weight'"),
    (lambda sd: sd.__setitem__("transformer.h.0.ln_1.bias", torch.zeros(65)),
     r"tensor 'transformer.h.0.ln_1.bias' has shape \[65\], the model expects \[64\]"),
    (lambda sd: sd.__setitem__("transformer.wpe.weight", sd["transformer.wpe.weight"].half()),
     r"tensor 'transformer.wpe.weight' is torch.float16, the model expects torch.float32"),
], ids=["missing", "shape", "dtype"])
def test_checkpoint_defects_name_tensor_and_file(tmp_path, mutate, message):
    path = checkpoint(tmp_path, mutate)
    model = meta_model()
    with pytest.raises(ValueError, match=message) as info:
        disk_offload(model, checkpoint=path)
    assert str(path) in str(info.value) or "w.safetensors" in str(info.value)
    assert model not in _offloaded and not model._forward_pre_hooks  # nothing attached


def test_truncated_checkpoint_names_tensor_and_file(tmp_path):
    path = checkpoint(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=r"w.safetensors: tensor '.*' ends at byte \d+ but the file has "
                                         rf"{size - 100} bytes \(truncated\)"):
        disk_offload(meta_model(), checkpoint=path)


@pytest.mark.parametrize("content", [b"", b"\x05\x00", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 3) + b"{x}"],
                         ids=["empty", "short", "huge-header", "bad-json"])
def test_not_a_safetensors_file(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.safetensors"):
        disk_offload(meta_model(), checkpoint=path)


def test_missing_checkpoint_and_shard(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        disk_offload(meta_model(), checkpoint=tmp_path / "nothing.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        disk_offload(meta_model(), checkpoint=tmp_path / "empty")
    resident_model().save_pretrained(tmp_path / "ck", max_shard_size="100KB")
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.unlink(tmp_path / "ck" / shard)
    with pytest.raises(ValueError, match=f"names shard .*{shard}, which does not exist"):
        disk_offload(meta_model(), checkpoint=tmp_path / "ck")


def test_offload_dir_under_a_file_is_an_oserror(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as info:
        disk_offload(resident_model(), tmp_path / "file" / "od")
    assert info.value.errno is not None and "file" in str(info.value.filename)


def test_read_only_offload_dir_leaves_nothing(readonly_dir):
    model = resident_model()
    before = sorted(os.listdir(readonly_dir))
    with pytest.raises(OSError) as info:
        disk_offload(model, readonly_dir)
    assert info.value.errno is not None
    assert sorted(os.listdir(readonly_dir)) == before
    assert model.transformer.wte.weight.device.type == "cpu"  # the model is untouched


class _Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(16))  # 64 MiB fp32


@pytest.mark.slow
@pytest.mark.parametrize("reserve", [True, False], ids=["reserved", "fills-while-writing"])
def test_full_disk_is_an_oserror_and_leaves_nothing(small_ext4_dir, monkeypatch, reserve):
    if not reserve:  # a file system without fallocate: the writes themselves hit ENOSPC
        def no_fallocate(fd, offset, length):
            raise OSError(95, "Operation not supported")
        monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    model = _Big()
    target = small_ext4_dir / "od"
    with pytest.raises(OSError) as info:
        disk_offload(model, target, buffer_bytes=1 << 20)
    assert info.value.errno == 28  # ENOSPC
    assert not target.exists()
    assert model.layers[0].weight.device.type == "cpu" and model not in _offloaded


def test_meta_model_with_an_empty_offload_dir(tmp_path):
    with pytest.raises(ValueError, match="is on the meta device and .* holds no swapio offload"):
        disk_offload(meta_model(), tmp_path / "od")


def test_cpu_offload_of_a_meta_model():
    with pytest.raises(ValueError, match="cpu_offload needs the model's weights"):
        cpu_offload(meta_model())


def test_offloading_twice_is_a_clear_error(tmp_path):
    model = cpu_offload(resident_model())
    for again in (lambda: cpu_offload(model), lambda: disk_offload(model, tmp_path / "od"),
                  lambda: cpu_offload_with_hook(model), lambda: cpu_offload(model.transformer)):
        with pytest.raises(ValueError, match="already offloaded"):
            again()
    with pytest.raises(ValueError, match="not one of its submodules"):
        remove_offload(model.transformer)
    remove_offload(model)
    with pytest.raises(ValueError, match="not offloaded"):
        remove_offload(model)


OFFLOADS = {"disk": lambda model, tmp: disk_offload(model, tmp / "od"), "cpu": lambda model, tmp: cpu_offload(model)}
CONVERSIONS = {
    "half": lambda m: m.half(), "bfloat16": lambda m: m.bfloat16(), "to-float64": lambda m: m.to(torch.float64),
    "to-meta": lambda m: m.to("meta"), "submodule-half": lambda m: m.transformer.h[1].half(),
    "another-device": lambda m: m.to("cuda:0"),  # (the model computes on the CPU)
}


@pytest.mark.slow
@pytest.mark.parametrize("convert", list(CONVERSIONS))
@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_a_conversion_of_an_offloaded_model_is_refused_before_anything_changed(tmp_path, kind, convert):
    model = OFFLOADS[kind](resident_model(), tmp_path)
    before = {n: (t.dtype, t.device) for n, t in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"remove_offload\(model\) first .* execution_device="):
        CONVERSIONS[convert](model)
    assert {n: (t.dtype, t.device) for n, t in model.state_dict().items()} == before  # resident buffers too
    assert_same_outputs(model)
    remove_offload(model)
    assert "_apply" not in model.__dict__ and "_apply" not in model.transformer.h[1].__dict__
    if convert != "another-device" or torch.cuda.is_available():
        CONVERSIONS[convert](model)  # back to normal: converts as torch does


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_a_conversion_to_the_same_dtype_and_execution_device_is_a_no_op(tmp_path, kind):
    """model.to(device) out of habit, accelerate's prepare: the offloaded model goes on working."""
    model = OFFLOADS[kind](resident_model(), tmp_path)
    for convert in (lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.float(), lambda m: m.to(torch.float32),
                    lambda m: m.to(torch.device("cpu"), torch.float32), lambda m: m.transformer.h[0].to("cpu")):
        assert convert(model) in (model, model.transformer.h[0])
        assert_same_outputs(model)
    remove_offload(model)
    assert_same_outputs(model)


@pytest.fixture
def swap_params_on_conversion():
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_a_no_op_conversion_with_swap_module_params_on_conversion(tmp_path, kind, swap_params_on_conversion):
    """torch.__future__.set_swap_module_params_on_conversion(True): torch's _apply swaps each parameter with what the
    conversion gives, the placeholder itself here, which failed ("Couldn't swap ...weight": swapio holds weak
    references to placeholders). The placeholders are left out of _apply, keeping their order in the module."""
    model = OFFLOADS[kind](resident_model(), tmp_path)
    names = [n for n, _ in model.named_parameters()]
    for convert in (lambda m: m.to("cpu"), lambda m: m.float(), lambda m: m.transformer.h[0].to(torch.float32)):
        convert(model)
        assert_same_outputs(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"remove_offload\(model\) first"):
        model.half()
    remove_offload(model)
    assert_same_outputs(model)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(offload_dir=123), TypeError, "offload_dir"),
    (dict(checkpoint=123), TypeError, "checkpoint"),
    (dict(keep_resident=5), TypeError, "keep_resident"),
    (dict(preload_module_classes=5), TypeError, "preload_module_classes"),
    (dict(progress="yes"), TypeError, "progress"),
    (dict(execution_device="tpu"), ValueError, "execution_device"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_mistyped_argument_is_named(tmp_path, kwargs, error, name):
    kwargs = {"offload_dir": tmp_path / "od", **kwargs} if "checkpoint" not in kwargs else kwargs
    model = resident_model()
    with pytest.raises(error, match=name):
        disk_offload(model, **kwargs)
    assert model not in _offloaded and not (tmp_path / "od").exists()


def test_bytes_paths_work_as_str_paths(tmp_path):
    model = disk_offload(resident_model(), os.fsencode(tmp_path / "od"))
    assert_same_outputs(model)
    remove_offload(model)
    resident_model().save_pretrained(tmp_path / "ck")
    assert_same_outputs(disk_offload(meta_model(), checkpoint=os.fsencode(tmp_path / "ck")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_load_file_to_cuda_without_cuda_is_a_runtime_error_saying_so(tmp_path, device):
    """load_file(checkpoint, device="cuda") (docs/offload.md's API table) on a machine without CUDA: a
    RuntimeError naming the device and the CPU instead, not torch's AssertionError or stream error."""
    from swapio.offload import load_file
    path = checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match=r"load_file\(device=.*\) needs CUDA, but .*device='cpu'"):
        load_file(path, device=device)
    assert torch.equal(load_file(path)["transformer.wte.weight"], resident_model().state_dict()["transformer.wte.weight"])
