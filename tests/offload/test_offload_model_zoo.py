"""The model zoo beyond hf_tiny's four: Gemma 1-3, Phi-3, GPT-NeoX, OPT, Bloom and Falcon (ALiBi), BERT (pooler;
masked LM with a tied decoder), Mixtral and Qwen2-MoE (experts a batch may not route to), Whisper (convolutions,
encoder-decoder), ViT and CLIP. Each is saved with save_pretrained, then offloaded three ways (from_pretrained of
that directory, disk_offload with an offload_dir, cpu_offload): every output tensor and the greedy tokens equal
the resident model's, or the offload is a clear error."""
import pytest
import torch

from helpers import hf_zoo
from swapio.offload import cpu_offload, disk_offload, from_pretrained, load_file, remove_offload

transformers = hf_zoo.transformers
MERGED = {"mixtral", "qwen2_moe"}  # transformers 5 merges their per-expert checkpoint tensors when loading
# Whisper's generate() builds its start tokens on model.device, which is the first parameter's: kept resident
KEEP = {"whisper": ["model.encoder.conv1"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            model = hf_zoo.resident(name)
            model.save_pretrained(directory)
            cache[name] = directory, hf_zoo.outputs(name, model)
        return cache[name]
    return get


def assert_same(name, model, want):
    got = hf_zoo.outputs(name, model)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", sorted(set(hf_zoo.ARCHS) - MERGED))
def test_from_pretrained(saved, name):
    directory, want = saved(name)
    model = from_pretrained(hf_zoo.arch(name)[1], directory, buffer_bytes=16 << 10, keep_resident=KEEP.get(name, ()))
    assert_same(name, model, want)


@pytest.mark.parametrize("name", sorted(hf_zoo.ARCHS))
def test_disk_offload(saved, tmp_path, name):
    _, want = saved(name)
    model = disk_offload(hf_zoo.resident(name), tmp_path / "od", buffer_bytes=16 << 10,
                         keep_resident=KEEP.get(name, ()))
    assert_same(name, model, want)
    remove_offload(model)


@pytest.mark.parametrize("name", sorted(hf_zoo.ARCHS))
def test_cpu_offload(saved, name):
    _, want = saved(name)
    model = cpu_offload(hf_zoo.resident(name), keep_resident=KEEP.get(name, ()))
    assert_same(name, model, want)
    remove_offload(model)


@pytest.mark.parametrize("name", ["gpt_neox", "vit"])
def test_checkpoint_names_transformers_renames_are_read_in_place(saved, name):
    """transformers 5 saves GPT-NeoX's lm_head as `embed_out` and ViT's layers under their older names, and renames
    them as it loads: from_pretrained (and disk_offload(checkpoint=...) of a model built on meta) was a ValueError,
    "checkpoint ... lacks tensor 'lm_head.weight'"."""
    directory, want = saved(name)
    config, cls = hf_zoo.arch(name)
    with torch.device("meta"):
        model = cls(config).eval()
    disk_offload(model, checkpoint=directory)
    assert_same(name, model, want)
    remove_offload(model)


@pytest.mark.parametrize("name", sorted(MERGED))
def test_merged_expert_checkpoint_is_a_clear_error_and_offload_dir_is_the_way(saved, tmp_path, name):
    """Mixtral's and Qwen2-MoE's per-expert tensors are concatenated into one fused tensor by transformers'
    loading; nothing in the file is that tensor, so reading in place is refused, naming it and the way out (which
    then works, and a later process reuses the offload_dir without the checkpoint)."""
    directory, want = saved(name)
    config, cls = hf_zoo.arch(name)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj' is not in "
                                         r"the checkpoint: transformers makes it when loading by merging(.|\n)*"
                                         r"from_pretrained, then disk_offload\(model, offload_dir=...\)"):
        from_pretrained(cls, directory)
    model = disk_offload(cls.from_pretrained(directory).eval(), tmp_path / "od", buffer_bytes=16 << 10)
    assert_same(name, model, want)
    remove_offload(model)
    with torch.device("meta"):
        again = cls(config).eval()
    disk_offload(again, tmp_path / "od")
    assert_same(name, again, want)
    remove_offload(again)


def test_whisper_generate_without_a_resident_first_module_is_a_clear_error(saved):
    """Whisper's generate() builds its start tokens on model.device, the meta placeholder's device: a RuntimeError
    that says what keeps model.device real, never a computation on meta values."""
    _, want = saved("whisper")
    model = cpu_offload(hf_zoo.resident("whisper"))
    features = hf_zoo.inputs("whisper")["input_features"]
    with pytest.raises(RuntimeError, match=r"on the meta device(.|\n)*such as Whisper(.|\n)*first parameter"):
        model.generate(input_features=features, max_new_tokens=2, do_sample=False)
    with torch.no_grad(), hf_zoo.one_thread():
        assert torch.equal(model(**hf_zoo.inputs("whisper")).logits, want["logits"])
    remove_offload(model)


@pytest.mark.parametrize("name", sorted(hf_zoo.ARCHS))
def test_save_pretrained_of_the_offloaded_model_writes_what_transformers_writes(saved, tmp_path, name):
    """transformers' save_pretrained writes converted tensors back in the checkpoint layout (save_original_format,
    its default: GPT-NeoX's lm_head as `embed_out`, Mixtral's and Qwen2-MoE's fused experts as one tensor per
    expert); the offloaded model's wrote its own names, then renamed but kept the experts fused, which older
    readers do not know. Now the same tensors under the same names, whatever the shards.
    save_original_format=False: the model's layout, as transformers."""
    directory, want = saved(name)
    model = cpu_offload(hf_zoo.resident(name), keep_resident=KEEP.get(name, ()))
    model.save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    loaded = hf_zoo.arch(name)[1].from_pretrained(tmp_path / "saved").eval()
    assert_same(name, loaded, want)
    got, expected = load_file(tmp_path / "saved"), load_file(directory)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    hf_zoo.resident(name).save_pretrained(tmp_path / "own_resident", save_original_format=False)
    model.save_pretrained(tmp_path / "own", save_original_format=False)
    assert load_file(tmp_path / "own").keys() == load_file(tmp_path / "own_resident").keys()
    remove_offload(model)


def test_a_base_model_from_a_directory_with_a_head(saved):
    """transformers' AutoModel.from_pretrained of a checkpoint saved with a head strips the base model's prefix
    (`gpt_neox.layers...` is GPTNeoXModel's `layers...`); swapio said "lacks tensor 'embed_in.weight'". A tensor
    the base model has and the checkpoint lacks (BERT's pooler, which transformers would initialize at random) is
    still a clear error, never random values."""
    directory, _ = saved("gpt_neox")
    want_model = transformers.GPTNeoXModel.from_pretrained(directory).eval()
    model = from_pretrained(transformers.AutoModel, directory)
    assert isinstance(model, transformers.GPTNeoXModel)
    ids = hf_zoo.inputs("gpt_neox")["input_ids"]
    with torch.no_grad(), hf_zoo.one_thread():
        assert torch.equal(model(ids).last_hidden_state, want_model(ids).last_hidden_state)
    with pytest.raises(ValueError, match="lacks tensor 'pooler.dense.weight'"):
        from_pretrained(transformers.BertModel, saved("bert_mlm")[0])
