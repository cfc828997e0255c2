"""Offloading a model inside torch's wrappers.

torch.compile(model) holds the model as `_orig_mod`, so every tensor name gains that segment, while the checkpoint
(saved from the plain model) does not have it: disk_offload(torch.compile(model), checkpoint=...) said "lacks tensor
'_orig_mod.a.weight'" and cpu_offload(..., state_dict=...) "state_dict has 7 key(s) that name no parameter". Such a
tensor is now looked up under its unwrapped name too (as accelerate's load_checkpoint_in_model reaches through the
wrapper), and save_checkpoint / save_pretrained write the plain model's names, as transformers' save_pretrained
of a compiled model does. DistributedDataParallel and DataParallel over offloaded weights cannot work (DDP's
gradient hooks are on the parameters, which an offloaded module does not compute with: two ranks trained apart
without a word): a ValueError naming the wrapper, before anything changes.
Backend "eager": no C++ compile."""
import os

import pytest
import torch

from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt,
                                      make_model, meta_model, one_thread, resident_run, save_checkpoint_file, train,
                                      weights)
from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(model):
    return torch.compile(model, backend="eager")


def _offload_from(how, model, ref, tmp_path):
    """Offloads `model` (built on meta) with `ref`'s weights: from its checkpoint, or cpu_offload's state_dict."""
    if how == "checkpoint":
        return disk_offload(model, checkpoint=save_checkpoint_file(ref, tmp_path / "ref.safetensors"))
    return cpu_offload(model, state_dict=ref.state_dict())


def _outputs(model, cls):
    with torch.no_grad(), one_thread():
        return [model(x) for x, _ in batches(cls, 2)]


def _assert_equal_outputs(got, want):
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("cls", [MLP, Tied])
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_compiled_model_offloads_from_the_plain_models_weights(tmp_path, cls, how):
    ref = make_model(cls)
    want = _outputs(_compiled(make_model(cls)), cls)  # the resident compiled model
    model = _offload_from(how, _compiled(meta_model(cls)), ref, tmp_path)
    _assert_equal_outputs(_outputs(model, cls), want)
    assert all(p.device.type == "meta" for p in model.parameters())  # offloaded, not resident
    remove_offload(model)
    assert_same_weights(weights(model._orig_mod), weights(ref))


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_compiled_submodule_offloads_from_the_plain_models_weights(tmp_path, how):
    """A submodule compiled in place: `b._orig_mod.weight` in the model, `b.weight` in the checkpoint."""
    ref = make_model(MLP)
    want = _outputs(ref, MLP)
    model = meta_model(MLP)
    model.b = _compiled(model.b)
    model = _offload_from(how, model, ref, tmp_path)
    _assert_equal_outputs(_outputs(model, MLP), want)


def test_compiled_peft_model_reads_the_base_models_checkpoint(tmp_path):
    """Both wrappers at once: `_orig_mod.base_model.model.b.base_layer.weight` is the checkpoint's `b.weight`."""
    peft = pytest.importorskip("peft")
    ref = make_model(MLP)
    lora = peft.LoraConfig(target_modules=["b"], r=2)  # lora_B starts at zero: the base model's outputs
    model = _compiled(peft.get_peft_model(make_model(MLP, seed=3), lora))
    disk_offload(model, checkpoint=save_checkpoint_file(ref, tmp_path / "ref.safetensors"))
    _assert_equal_outputs(_outputs(model, MLP), _outputs(ref, MLP))


def test_the_wrapped_models_own_names_are_found_first(tmp_path):
    """A checkpoint of the compiled model's state_dict (torch's names, `_orig_mod.` included) reads as before."""
    ref = _compiled(make_model(MLP))
    ckpt = tmp_path / "compiled.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(ckpt))
    model = disk_offload(_compiled(meta_model(MLP)), checkpoint=ckpt)
    _assert_equal_outputs(_outputs(model, MLP), _outputs(ref, MLP))


def test_a_weight_given_under_both_names_is_refused():
    ref = make_model(MLP)
    given = {**ref.state_dict(), "_orig_mod.a.weight": ref.a.weight.detach()}
    with pytest.raises(ValueError, match=r"name no parameter or buffer.*'a\.weight'"):
        cpu_offload(_compiled(meta_model(MLP)), state_dict=given)


@pytest.mark.parametrize("cls", [MLP, Tied])
def test_save_checkpoint_of_a_compiled_offloaded_model_writes_the_plain_names(tmp_path, cls):
    ref = make_model(cls)
    model = disk_offload(_compiled(meta_model(cls)), checkpoint=save_checkpoint_file(ref, tmp_path / "ref.safetensors"))
    save_checkpoint(model, tmp_path / "out.safetensors")
    saved = load_file(str(tmp_path / "out.safetensors"))
    want = load_file(str(tmp_path / "ref.safetensors"))  # the plain model's, ties stored once
    assert sorted(saved) == sorted(want)
    assert all(torch.equal(saved[k], want[k]) for k in want)


def test_compiled_model_from_checkpoint_trains_as_the_resident_model(tmp_path):
    data = batches(MLP, 3)
    want_losses, want = resident_run(MLP, torch.float32, "AdamW", data, tmp_path, 1, {})
    ckpt = save_checkpoint_file(make_model(MLP), tmp_path / "ref.safetensors")
    model = disk_offload(_compiled(meta_model(MLP)), checkpoint=ckpt, offload_dir=tmp_path / "od")
    with build_opt("AdamW", model.parameters(), tmp_path) as opt:
        assert_same_losses(train(model, opt, data), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model._orig_mod), want)


def _tensors_in(directory):
    """{name: tensor} of every safetensors file in `directory` (one file, or save_pretrained's shards)."""
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_compiled_transformers_model_from_its_directory_and_save_pretrained(tmp_path):
    """A tied transformers model (Qwen2) built on meta, compiled, read from save_pretrained's directory: outputs
    equal the resident compiled model's; its save_pretrained writes what transformers' writes of it (the plain
    model's names, ties once)."""
    hf_tiny = pytest.importorskip("helpers.hf_tiny")
    resident = hf_tiny.save("qwen2", tmp_path / "ref")
    ids = hf_tiny.inputs()
    with torch.no_grad(), one_thread():
        want = _compiled(resident)(ids).logits
    model = _compiled(hf_tiny.build_empty("qwen2", "meta"))
    disk_offload(model, checkpoint=tmp_path / "ref")
    with torch.no_grad(), one_thread():
        assert torch.equal(model(ids).logits, want)
    _compiled(resident).save_pretrained(tmp_path / "transformers")
    model.save_pretrained(tmp_path / "swapio")
    theirs, ours = _tensors_in(tmp_path / "transformers"), _tensors_in(tmp_path / "swapio")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ---- DistributedDataParallel, DataParallel: refused --------------------------------------------------------------
@pytest.fixture
def process_group(tmp_path):
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch without torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


@pytest.mark.parametrize("offload", ["disk", "checkpoint", "cpu", "state_dict"])
@pytest.mark.parametrize("wrapper", ["ddp", "data_parallel", "ddp_inside"])
def test_data_parallel_wrappers_are_refused_naming_the_way_out(tmp_path, process_group, offload, wrapper):
    ref = make_model(MLP)
    if wrapper == "ddp_inside":  # a part of the model wrapped
        model = make_model(MLP)
        model.b = _ddp(model.b)
        name, where = "DistributedDataParallel", "b.module"
    else:
        model = _ddp(make_model(MLP)) if wrapper == "ddp" else torch.nn.DataParallel(make_model(MLP))
        name, where = type(model).__name__, "model.module"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{name} over offloaded weights is not supported.*\({where}\)"):
        if offload == "disk":
            disk_offload(model, offload_dir=tmp_path / "od")
        elif offload == "checkpoint":
            disk_offload(model, checkpoint=save_checkpoint_file(ref, tmp_path / "ref.safetensors"))
        elif offload == "cpu":
            cpu_offload(model)
        else:
            cpu_offload(model, state_dict=ref.state_dict())
    assert not os.path.exists(tmp_path / "od")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # left as it was
