"""Hugging Face and accelerate entry points on an offloaded model: model.save_pretrained(dir), from_pretrained of
a save_checkpoint directory, Accelerator().prepare(model, opt). Each gives what the resident model gives."""
import os

import pytest
import torch

from helpers.offload import assert_same_outputs, config, reference, resident_model, transformers
from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint
import swapio.optim as so

OFFLOADS = {"disk": lambda tmp: disk_offload(resident_model(), tmp / "od", buffer_bytes=64 << 10),
            "cpu": lambda tmp: cpu_offload(resident_model())}


def assert_loads_as_the_resident_model(directory):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert isinstance(loaded, transformers.GPT2LMHeadModel)
    assert loaded.config.n_embd == config().n_embd and loaded.config.vocab_size == config().vocab_size
    assert_same_outputs(loaded)


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["one-shard", "sharded"])
@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_save_pretrained_of_an_offloaded_model(tmp_path, kind, sharded):
    model = OFFLOADS[kind](tmp_path)
    kwargs = {"max_shard_size": "100KB"} if sharded else {}
    model.save_pretrained(tmp_path / "saved", **kwargs)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(
        os.listdir(tmp_path / "saved"))
    assert_loads_as_the_resident_model(tmp_path / "saved")
    assert_same_outputs(model)  # the offloaded model goes on working
    for bad in ({"state_dict": resident_model().state_dict()}, {"push_to_hub": True}, {"variant": "fp16"}):
        with pytest.raises(ValueError, match="remove_offload"):
            model.save_pretrained(tmp_path / "refused", **bad)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such'"):
        model.save_pretrained(tmp_path / "refused", no_such=1)
    assert not (tmp_path / "refused").exists()
    remove_offload(model)
    assert "save_pretrained" not in model.__dict__  # transformers' own again
    model.save_pretrained(tmp_path / "resident")
    assert_loads_as_the_resident_model(tmp_path / "resident")


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_a_save_checkpoint_directory_loads_with_from_pretrained(tmp_path, kind):
    model = OFFLOADS[kind](tmp_path)
    save_checkpoint(model, tmp_path / "export", max_shard_size="100KB")
    assert_loads_as_the_resident_model(tmp_path / "export")  # config.json written with the weights
    remove_offload(model)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_accelerator_prepare_of_an_offloaded_model_and_its_optimizer(tmp_path, kind):
    accelerate = pytest.importorskip("accelerate")
    model = OFFLOADS[kind](tmp_path)
    opt = so.OffloadAdamW(model.parameters(), lr=1e-3, offload="cpu")
    prepared, prepared_opt = accelerate.Accelerator(cpu=True).prepare(model, opt)
    assert prepared is model
    assert_same_outputs(prepared)
    ids = reference()[0]
    loss = prepared(ids, labels=ids).loss
    loss.backward()
    prepared_opt.step()  # a step through accelerate's wrapper moves the weights, like the resident model's would
    resident = resident_model()
    want = torch.optim.AdamW(resident.parameters(), lr=1e-3, weight_decay=0.01)
    resident(ids, labels=ids).loss.backward()
    want.step()
    remove_offload(model)
    for (name, got), expected in zip(model.named_parameters(), resident.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=name)
    opt.close()


@pytest.mark.parametrize("sharded", [False, True], ids=["model.safetensors", "sharded"])
def test_saving_over_the_checkpoint_the_model_reads_in_place_is_refused(tmp_path, sharded):
    """from_pretrained reads the weights in place: a save into that directory replaced or removed those files, and
    the model then computed with another export's bytes at the old offsets (or failed to open a removed shard)."""
    from helpers import hf_tiny
    from swapio.offload import from_pretrained
    reference = hf_tiny.save("llama", tmp_path, sharded=sharded)
    model = from_pretrained(hf_tiny.arch("llama")[1], tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    source = sorted(n for n in before if n.endswith(".safetensors"))[0]
    for save in (lambda: model.save_pretrained(tmp_path), lambda: model.save_pretrained(tmp_path, max_shard_size="9KB"),
                 lambda: save_checkpoint(model, tmp_path / source)):
        with pytest.raises(ValueError, match="reads its weights in place"):
            save()
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before  # nothing touched
    want = hf_tiny.run(reference)
    got = hf_tiny.run(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    model.save_pretrained(tmp_path / "elsewhere", max_shard_size="9KB")  # another directory is fine
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "elsewhere")
    for k, v in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    remove_offload(model)


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_inputs_moved_to_model_device_are_refused_not_computed(tmp_path, kind):
    """transformers' habit `inputs.to(model.device)`: model.device is the first parameter's device, which for an
    offloaded model is its meta placeholder's. Such inputs gave silently wrong logits on the CPU (an embedding of
    meta indices reads uninitialised memory) and a meta-tensor copy error on a GPU. They are a RuntimeError
    naming the input and the execution device (generate fails on them before any forward); the model goes on
    working."""
    model = OFFLOADS[kind](tmp_path)
    ids = reference()[0]
    assert model.device.type == "meta"
    with pytest.raises(RuntimeError, match=r"input_ids is on the meta device(.|\n)*execution device \(cpu\)"):
        model(input_ids=ids.to(model.device))
    with pytest.raises(RuntimeError, match=r"on the meta device(.|\n)*execution device"):
        model(ids.to(model.device))
    with pytest.raises(RuntimeError, match="meta"):  # generate reads the ids itself first: torch's error, loud
        model.generate(ids.to(model.device), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert_same_outputs(model)
    remove_offload(model)


def test_a_meta_input_to_an_offloaded_submodule_is_refused(tmp_path):
    net = disk_offload(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), tmp_path / "od")
    with pytest.raises(RuntimeError, match=r"argument 0 is on the meta device(.|\n)*execution device \(cpu\)"):
        net[1](torch.randn(3, 4, device="meta"))
    assert net(torch.ones(1, 4)).shape == (1, 2)
    remove_offload(net)


@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_resize_token_embeddings_of_offloaded_embeddings_says_what_to_do(tmp_path, kind):
    """transformers builds the new embedding from the old one's values, a meta placeholder between forwards: it
    failed with torch's "Tensor.item() cannot be called on meta tensors". Refused before anything changed; with
    both embeddings resident (keep_resident) it resizes as the resident model does."""
    from helpers import hf_tiny
    ref = hf_tiny.resident("llama")
    offload = (lambda m, **kw: disk_offload(m, tmp_path / "od", **kw)) if kind == "disk" else cpu_offload
    model = offload(hf_tiny.resident("llama"))
    with pytest.raises(RuntimeError, match=r"resize_token_embeddings of a model offloaded by swapio: its input "
                                           r"embedding's weight is offloaded.*keep_resident"):
        model.resize_token_embeddings(hf_tiny.VOCAB + 8)
    assert torch.equal(hf_tiny.run(model)[0], hf_tiny.run(ref)[0])
    remove_offload(model)
    kept = offload(hf_tiny.resident("llama"), keep_resident=["model.embed_tokens", "lm_head"])
    ref.resize_token_embeddings(hf_tiny.VOCAB + 8, mean_resizing=False)
    kept.resize_token_embeddings(hf_tiny.VOCAB + 8, mean_resizing=False)
    ids = hf_tiny.inputs()
    with torch.no_grad():
        got, want = kept(ids).logits, ref(ids).logits
    assert got.shape == want.shape == (*ids.shape, hf_tiny.VOCAB + 8)
    assert torch.equal(got[..., :hf_tiny.VOCAB], want[..., :hf_tiny.VOCAB])  # the new rows are drawn at random
