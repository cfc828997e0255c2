"""save_pretrained of an offloaded transformers model writes what transformers' own save_pretrained writes of the
resident model (save_original_format): converted tensors split back by transformers' own rules, streamed through
the offload ring and across shards, without the keys it ignores on save; what cannot be streamed or reverted is
a clear error, and nothing written."""
import pytest
import torch

from helpers import hf_zoo
from swapio.offload import disk_offload, load_file, remove_offload

transformers = hf_zoo.transformers
core = pytest.importorskip("transformers.core_model_loading")


def _resident_files(name, directory):
    model = hf_zoo.resident(name)
    model.save_pretrained(directory)
    return model, load_file(directory)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_experts_are_written_per_expert_through_the_ring_and_across_shards(tmp_path, name):
    """Mixtral's fused experts were written fused: transformers writes each expert's matrices. Offloaded to disk
    with a ring smaller than the model and shards smaller than a fused tensor, so that one tensor's experts
    straddle shards and records come and go between them."""
    resident, expected = _resident_files(name, tmp_path / "transformers")
    model = disk_offload(hf_zoo.resident(name), tmp_path / "od", buffer_bytes=16 << 10)
    model.save_pretrained(tmp_path / "swapio", max_shard_size="24KB")
    got = load_file(tmp_path / "swapio")
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in expected)
    assert len(list((tmp_path / "swapio").glob("model-*.safetensors"))) > 2
    loaded = hf_zoo.arch(name)[1].from_pretrained(tmp_path / "swapio").eval()
    ids = hf_zoo.inputs(name)["input_ids"]
    with torch.no_grad(), hf_zoo.one_thread():
        assert torch.equal(loaded(ids).logits, resident(ids).logits)
        assert torch.equal(model(ids).logits, resident(ids).logits)  # the model itself is left as it was
    remove_offload(model)


def _fused_qkv_gemma():
    """A Gemma loaded (as transformers records it) from a checkpoint with one fused qkv per layer: its
    save_pretrained writes q, k and v back as one tensor."""
    model = hf_zoo.resident("gemma")
    model._weight_conversions = [core.WeightConverter(
        source_patterns="self_attn.qkv_proj.weight",
        target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[core.Chunk(dim=0)])]
    return model


def test_a_tensor_written_from_several_is_a_clear_error(tmp_path):
    resident = _fused_qkv_gemma()
    resident.save_pretrained(tmp_path / "transformers")
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_file(tmp_path / "transformers")
    model = disk_offload(_fused_qkv_gemma(), tmp_path / "od", buffer_bytes=16 << 10)
    with pytest.raises(ValueError, match=r"transformers writes 'model\.layers\.0\.self_attn\.qkv_proj\.weight' from "
                                         r"several of the model's tensors at once \('model\.layers\.0\.self_attn\.k_"
                                         r"(.|\n)*save_original_format=False"):
        model.save_pretrained(tmp_path / "swapio")
    assert not (tmp_path / "swapio").exists()
    model.save_pretrained(tmp_path / "own", save_original_format=False)  # the way out works
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(tmp_path / "own")
    remove_offload(model)


class _NoWayBack(core.ConversionOps):
    """A loading conversion transformers has no reverse for."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: next(iter(input_dict.values()))}


def test_a_conversion_transformers_cannot_revert_is_a_clear_error(tmp_path):
    resident = hf_zoo.resident("gemma")
    resident._weight_conversions = [core.WeightConverter(
        source_patterns="self_attn.o.weight", target_patterns="self_attn.o_proj.weight", operations=[_NoWayBack()])]
    with pytest.raises(NotImplementedError):  # transformers' own save fails too
        resident.save_pretrained(tmp_path / "transformers")
    model = disk_offload(resident, tmp_path / "od", buffer_bytes=16 << 10)
    with pytest.raises(ValueError, match=r"transformers cannot convert the model's tensors back to the gemma "
                                         r"checkpoint layout(.|\n)*save_original_format=False"):
        model.save_pretrained(tmp_path / "swapio")
    assert not (tmp_path / "swapio").exists()
    remove_offload(model)


def test_keys_transformers_ignores_on_save_are_not_written(tmp_path):
    """Marian's sinusoidal position embeddings are parameters its loading computes (_keys_to_ignore_on_save):
    transformers' save_pretrained leaves them out, swapio's wrote them."""
    config = transformers.MarianConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=0,
                                       decoder_start_token_id=0)
    torch.manual_seed(0)
    resident = transformers.MarianMTModel(config).eval()
    resident.save_pretrained(tmp_path / "transformers")
    torch.manual_seed(0)
    model = disk_offload(transformers.MarianMTModel(config).eval(), tmp_path / "od", buffer_bytes=16 << 10)
    model.save_pretrained(tmp_path / "swapio")
    got, expected = load_file(tmp_path / "swapio"), load_file(tmp_path / "transformers")
    assert sorted(got) == sorted(expected) and "model.encoder.embed_positions.weight" not in got
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    ids = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    loaded = transformers.MarianMTModel.from_pretrained(tmp_path / "swapio").eval()
    with torch.no_grad(), hf_zoo.one_thread():
        want = resident(input_ids=ids, decoder_input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids, decoder_input_ids=ids).logits, want)
    remove_offload(model)


def test_the_models_own_layout_is_what_swapio_reads_in_place(tmp_path):
    """The per-expert layout is transformers' (swapio's from_pretrained refuses it, saying so);
    save_original_format=False keeps the fused tensors, which it reads in place."""
    from swapio.offload import from_pretrained
    resident = hf_zoo.resident("mixtral")
    model = disk_offload(hf_zoo.resident("mixtral"), tmp_path / "od", buffer_bytes=16 << 10)
    model.save_pretrained(tmp_path / "original")
    model.save_pretrained(tmp_path / "own", save_original_format=False)
    remove_offload(model)
    with pytest.raises(ValueError, match=r"merging(.|\n)*save_original_format=False"):
        from_pretrained(transformers.MixtralForCausalLM, tmp_path / "original")
    again = from_pretrained(transformers.MixtralForCausalLM, tmp_path / "own", buffer_bytes=16 << 10)
    ids = hf_zoo.inputs("mixtral")["input_ids"]
    with torch.no_grad(), hf_zoo.one_thread():
        assert torch.equal(again(ids).logits, resident(ids).logits)
    remove_offload(again)
