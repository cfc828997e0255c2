"""Build on meta, then disk_offload(checkpoint=...): transformers models of four architectures, saved with
save_pretrained (one file and sharded), built under torch.device("meta") and under accelerate's
init_empty_weights(), give exactly the resident model's logits and greedy tokens. Covers what no checkpoint holds:
RoPE's non-persistent inv_freq (computed again) and a tie stored under one name (tied again)."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload
from helpers import hf_tiny


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch, sharded -> (checkpoint directory, resident logits and tokens), saved once per module."""
    cache = {}

    def get(name, sharded):
        key = (name, sharded)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{name}-{'sharded' if sharded else 'single'}")
            model = hf_tiny.save(name, directory, sharded)
            cache[key] = directory, hf_tiny.run(model)
        return cache[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("how", ["meta", "accelerate"])
@pytest.mark.parametrize("name", sorted(hf_tiny.ARCHS))
def test_model_built_without_weights_equals_resident(saved, name, how, sharded):
    directory, (logits, tokens) = saved(name, sharded)
    if sharded:
        assert (directory / "model.safetensors.index.json").exists()
    model = hf_tiny.build_empty(name, how)
    disk_offload(model, checkpoint=directory, buffer_bytes=16 << 10)  # a ring smaller than the model
    got_logits, got_tokens = hf_tiny.run(model)
    assert torch.equal(got_logits, logits)
    assert torch.equal(got_tokens, tokens)
    remove_offload(model)


def test_tie_stored_under_the_other_name_is_honoured(tmp_path):
    """A checkpoint that holds the tied weight as lm_head.weight only (not the embedding's name)."""
    from safetensors.torch import save_file
    model = hf_tiny.resident("qwen2")
    state = {k: v for k, v in model.state_dict().items() if k != "model.embed_tokens.weight"}
    state["lm_head.weight"] = model.lm_head.weight.detach().clone()
    save_file(state, tmp_path / "model.safetensors")
    want = hf_tiny.run(model)
    empty = hf_tiny.build_empty("qwen2", "accelerate")
    disk_offload(empty, checkpoint=tmp_path)
    got = hf_tiny.run(empty)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class Rotary(torch.nn.Module):
    """Not a transformers model: a non-persistent buffer that only its constructor can compute."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.freq


def test_uncomputable_buffer_on_meta_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file
    save_file(Rotary().state_dict(), tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(ValueError, match=r"freq stays resident but is on the meta device, and .* does not hold "
                                         r"its values: it is a non-persistent buffer.*init_empty_weights"):
        disk_offload(model, checkpoint=tmp_path / "m.safetensors")


def test_offload_buffers_keeps_buffers_the_checkpoint_lacks_resident(saved):
    """offload_buffers=True offloads the buffers the checkpoint holds; inv_freq, which it cannot, stays resident."""
    directory, (logits, tokens) = saved("llama", False)
    model = hf_tiny.build_empty("llama", "meta")
    disk_offload(model, checkpoint=directory, offload_buffers=True)
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"
    got_logits, got_tokens = hf_tiny.run(model)
    assert torch.equal(got_logits, logits) and torch.equal(got_tokens, tokens)


def test_meta_model_reusing_an_offload_dir_gets_its_buffers(saved, tmp_path):
    """accelerate's behaviour for an existing offload folder: a model on meta reuses it; inv_freq is computed."""
    directory, (logits, tokens) = saved("llama", False)
    first = hf_tiny.build_empty("llama", "meta")
    disk_offload(first, checkpoint=directory)
    remove_offload(first)  # resident again: write its weights to an offload_dir
    disk_offload(first, offload_dir=tmp_path / "od")
    remove_offload(first)
    model = disk_offload(hf_tiny.build_empty("llama", "meta"), offload_dir=tmp_path / "od")
    got_logits, got_tokens = hf_tiny.run(model)
    assert torch.equal(got_logits, logits) and torch.equal(got_tokens, tokens)


@pytest.mark.parametrize("how", ["meta", "accelerate"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_cpu_offload_state_dict_of_a_model_built_without_weights_equals_resident(tmp_path, name, how):
    """cpu_offload(state_dict=) gets what disk_offload(checkpoint=) gets: computed rotary buffers, ties made again."""
    from safetensors.torch import load_file
    resident = hf_tiny.save(name, tmp_path)
    want = hf_tiny.run(resident)
    model = cpu_offload(hf_tiny.build_empty(name, how), state_dict=load_file(tmp_path / "model.safetensors"))
    got = hf_tiny.run(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
