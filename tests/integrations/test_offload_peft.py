"""peft LoRA on an offloaded model, in both orders, with peft itself: get_peft_model after offloading (its
adapters must be real tensors on the execution device, not meta) and offloading a peft model (adapters stay
resident and trainable; its base weights are found in the base model's checkpoint under peft's names). Loss and
every LoRA gradient equal the resident model's under the same peft setup (same seed before get_peft_model)."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload, stats
from helpers import hf_tiny

peft = pytest.importorskip("peft")


def lora_config(name):
    targets = ["q", "v"] if name == "t5" else ["q_proj", "v_proj", "down_proj"]
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")


def add_lora(model, name):
    torch.manual_seed(3)  # the adapters' initial values
    return peft.get_peft_model(model, lora_config(name))


def train_step(model):
    """Loss and the LoRA gradients of one forward and backward."""
    ids = hf_tiny.inputs()
    with hf_tiny.one_thread():
        if model.config.is_encoder_decoder:
            loss = model(input_ids=ids, labels=ids[:, :4].contiguous()).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert sorted(got[1]) == sorted(want[1]) and len(want[1]) > 0
    for k, g in want[1].items():
        assert got[1][k] is not None and got[1][k].device.type == "cpu", k
        assert torch.equal(got[1][k], g), k


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in ("llama", "t5"):
        directory = tmp_path_factory.mktemp(name)
        hf_tiny.save(name, directory)
        out[name] = directory, train_step(add_lora(hf_tiny.resident(name), name))
    return out


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize("how", ["disk-checkpoint", "disk-dir", "cpu"])
def test_lora_added_after_offloading_trains_like_resident(checkpoints, tmp_path, name, how):
    directory, want = checkpoints[name]
    if how == "disk-checkpoint":
        model = hf_tiny.build_empty(name, "meta")
        disk_offload(model, checkpoint=directory, buffer_bytes=16 << 10)
    else:
        model = hf_tiny.resident(name)
        if how == "disk-dir":
            disk_offload(model, offload_dir=tmp_path / "od", buffer_bytes=16 << 10)
        else:
            cpu_offload(model)
    model = add_lora(model, name)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.device.type == "cpu" for p in lora)  # not meta
    assert_same(train_step(model), want)
    if how != "cpu":
        assert stats(model.get_base_model())["refetches"] > 0  # the base weights were streamed in backward too


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize("how", ["disk-checkpoint", "disk-dir"])
def test_peft_model_offloaded_trains_like_resident(checkpoints, tmp_path, name, how):
    directory, want = checkpoints[name]
    model = add_lora(hf_tiny.resident(name), name)
    if how == "disk-checkpoint":  # the base model's checkpoint: names without peft's prefix and base_layer
        disk_offload(model, checkpoint=directory, buffer_bytes=16 << 10)
    else:
        disk_offload(model, offload_dir=tmp_path / "od", buffer_bytes=16 << 10)
    assert all(p.device.type == "cpu" for n, p in model.named_parameters() if "lora_" in n)  # stayed resident
    assert_same(train_step(model), want)
    remove_offload(model)
    assert_same(train_step(model), train_step_twice_reference(name))


def train_step_twice_reference(name):
    """The resident peft model after two train steps' gradients accumulated (the second step above runs after
    remove_offload, on the same model, so its gradients add to the first's)."""
    model = add_lora(hf_tiny.resident(name), name)
    train_step(model)
    return train_step(model)


def test_adapters_made_on_meta_by_peft_name_the_other_order(checkpoints):
    """peft on a model built on meta moves its new adapters to meta: no checkpoint holds them."""
    directory, _ = checkpoints["llama"]
    model = add_lora(hf_tiny.build_empty("llama", "meta"), "llama")
    with pytest.raises(ValueError, match=r"lora_A.default.weight stays resident but is on the meta device.*"
                                         r"call get_peft_model after disk_offload"):
        disk_offload(model, checkpoint=directory)


def test_modules_to_save_after_offloading(checkpoints, tmp_path):
    """peft's modules_to_save deep-copies its modules: an offloaded one refuses the copy (a copy would compute
    with NaN stand-ins), one kept resident is copied and trains like the resident model's."""
    config = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],  # noqa: E731
                                     modules_to_save=["lm_head"], init_lora_weights="gaussian")
    resident = hf_tiny.resident("llama")
    torch.manual_seed(3)
    want = train_step(peft.get_peft_model(resident, config()))
    model = disk_offload(hf_tiny.resident("llama"), offload_dir=tmp_path / "a", buffer_bytes=16 << 10)
    with pytest.raises(TypeError, match="modules_to_save"):
        peft.get_peft_model(model, config())
    model = disk_offload(hf_tiny.resident("llama"), offload_dir=tmp_path / "b", buffer_bytes=16 << 10,
                         keep_resident=["lm_head"])
    torch.manual_seed(3)
    assert_same(train_step(peft.get_peft_model(model, config())), want)


@pytest.mark.parametrize("how", ["disk-dir", "cpu"])
def test_adapter_save_pretrained_on_an_offloaded_base(checkpoints, tmp_path, how):
    """What docs/offload.md says to do instead of merging: peft's save_pretrained of the adapter alone, read
    from the model's state_dict() while the base weights are offloaded placeholders, writes the resident
    peft model's adapter exactly."""
    resident = add_lora(hf_tiny.resident("llama"), "llama")
    train_step(resident)
    resident.save_pretrained(tmp_path / "want")
    model = hf_tiny.resident("llama")
    if how == "disk-dir":
        disk_offload(model, offload_dir=tmp_path / "od", buffer_bytes=16 << 10)
    else:
        cpu_offload(model)
    model = add_lora(model, "llama")
    train_step(model)  # a forward: the base weights are placeholders again when the adapter is saved
    model.save_pretrained(tmp_path / "got")
    from safetensors.torch import load_file
    got, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("got", "want"))
    assert sorted(got) == sorted(want) and want
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("forward_first", [False, True])
def test_adapter_save_with_embedding_layers_refuses_the_base_embeddings(tmp_path, forward_first):
    """LoRA on the embeddings: peft's save_pretrained saves the base embedding weights too (save_embedding_layers
    "auto"), read from state_dict(). Right after get_peft_model they were the stand-ins, written as NaN without a
    word; now a RuntimeError naming the weight, as after a forward. save_embedding_layers=False saves the adapter."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    config = dict(r=4, target_modules=["q_proj", "embed_tokens"], init_lora_weights="gaussian")
    torch.manual_seed(3)
    want = peft.get_peft_model(hf_tiny.resident("llama"), peft.LoraConfig(**config))
    torch.manual_seed(3)
    model = peft.get_peft_model(cpu_offload(hf_tiny.resident("llama")), peft.LoraConfig(**config))
    if forward_first:
        hf_tiny.run(model)
    with pytest.raises(RuntimeError, match=r"embed_tokens\.weight is offloaded by swapio"):
        model.save_pretrained(tmp_path / "a")
    model.save_pretrained(tmp_path / "b", save_embedding_layers=False)
    saved = safetensors_torch.load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    expected = peft.get_peft_model_state_dict(want, save_embedding_layers=False)
    assert sorted(saved) == sorted(expected) and all(torch.equal(saved[k], v) for k, v in expected.items())


def test_resize_token_embeddings_of_an_offloaded_peft_model_says_what_to_do(tmp_path):
    """peft forwards resize_token_embeddings to the transformers model it wraps, whose guard was installed only on
    an offloaded transformers model: torch's "Tensor.item() cannot be called on meta tensors" instead of swapio's
    error, before anything changed."""
    model = add_lora(hf_tiny.resident("llama"), "llama")
    disk_offload(model, offload_dir=tmp_path / "od", buffer_bytes=16 << 10)
    with pytest.raises(RuntimeError, match=r"resize_token_embeddings of a model offloaded by swapio: its input "
                                           r"embedding's weight is offloaded.*keep_resident"):
        model.resize_token_embeddings(hf_tiny.VOCAB + 8)
    assert_same(train_step(model), resident_step("llama"))
    remove_offload(model)
    assert "resize_token_embeddings" not in model.get_base_model().__dict__  # the guard went with the offload


def resident_step(name):
    return train_step(add_lora(hf_tiny.resident(name), name))
