"""generate() paths where transformers builds tensors on model.device, the meta placeholder's device for an
offloaded model: assisted generation, prompt lookup, generate() without input_ids, a static cache with
prefill_chunk_size. Each is a RuntimeError naming the module to keep resident (they failed with torch's
"Tensor.item() cannot be called on meta tensors", or swapio's meta-input error pointing at Whisper); with that
module resident, each gives the resident model's tokens. The model goes on generating after the error.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from swapio.offload import cpu_offload, disk_offload, remove_offload  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
             bos_token_id=1)
IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
PATHS = {
    "assistant_model": lambda assistant: dict(input_ids=IDS, assistant_model=assistant),
    "prompt_lookup": lambda assistant: dict(input_ids=IDS, prompt_lookup_num_tokens=2),
    "no_input_ids": lambda assistant: dict(),
    "static_cache_chunked_prefill": lambda assistant: dict(input_ids=IDS, cache_implementation="static",
                                                           prefill_chunk_size=2),
}


def _llama(layers):
    torch.manual_seed(layers)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, num_hidden_layers=layers)).eval()


def _offload(model, how, tmp_path, **kwargs):
    if how == "disk":
        return disk_offload(model, tmp_path / "off", **kwargs)
    return cpu_offload(model, **kwargs)


def _generate(model, path, assistant):
    return model.generate(**PATHS[path](assistant), max_new_tokens=5, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("how", ["disk", "cpu"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_paths_on_model_device_name_the_module_to_keep_resident(tmp_path, path, how):
    resident, assistant = _llama(2), _llama(1)
    expected = _generate(resident, path, assistant)
    offloaded = _offload(copy.deepcopy(resident), how, tmp_path)
    with pytest.raises(RuntimeError, match=r"model.device(.|\n)*keep_resident=\['model.embed_tokens'\]"):
        _generate(offloaded, path, assistant)
    assert torch.equal(offloaded.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0),
                       resident.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0))
    remove_offload(offloaded)
    assert "generate" not in vars(offloaded)  # transformers' own generate again
    kept = _offload(copy.deepcopy(resident), how, tmp_path, keep_resident=["model.embed_tokens"])
    assert torch.equal(_generate(kept, path, assistant), expected)


def test_an_offloaded_assistant_model_names_its_own_module_to_keep_resident(tmp_path):
    """Assisted generation calls the assistant's generate(), which builds on the assistant's model.device: the error
    names the assistant (one error, not wrapped again by an offloaded main model's generate); kept, it assists."""
    resident, assistant = _llama(2), _llama(1)
    expected = _generate(resident, "assistant_model", assistant)
    offloaded_assistant = disk_offload(copy.deepcopy(assistant), tmp_path / "assistant")
    main = cpu_offload(copy.deepcopy(resident), keep_resident=["model.embed_tokens"])
    for model in (resident, main, cpu_offload(copy.deepcopy(resident))):
        with pytest.raises(RuntimeError, match=r"assistant_model(.|\n)*keep_resident=\['model.embed_tokens'\]") as info:
            _generate(model, "assistant_model", offloaded_assistant)
        assert "generate() of a" not in str(info.value.__cause__)  # said once
    kept = disk_offload(copy.deepcopy(assistant), tmp_path / "kept", keep_resident=["model.embed_tokens"])
    assert torch.equal(_generate(main, "assistant_model", kept), expected)


def test_other_errors_of_generate_pass_through_unchanged(tmp_path):
    """Only errors on the meta device are explained: another error (here a streamer's, mentioning metadata) is
    raised as it was."""
    class FailingStreamer(transformers.generation.streamers.BaseStreamer):
        def put(self, value):
            raise RuntimeError("bad metadata in the stream")

        def end(self):
            pass

    offloaded = disk_offload(_llama(2), tmp_path / "off")
    with pytest.raises(RuntimeError, match="^bad metadata in the stream$"):
        offloaded.generate(IDS, max_new_tokens=2, do_sample=False, pad_token_id=0, streamer=FailingStreamer())


def test_a_pipeline_given_device_minus_one_is_told_to_pass_the_execution_device(tmp_path):
    """pipeline(device=-1) takes model.device (meta) as its device and moves the inputs there: the error says to
    pass the execution device; given it, the pipeline computes as over the resident model."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    resident = _llama(2)
    offloaded = disk_offload(copy.deepcopy(resident), tmp_path / "off")
    kwargs = dict(max_new_tokens=3, do_sample=False)
    with pytest.raises(RuntimeError, match=r"pipeline given device=-1(.|\n)*device='cpu'"):
        transformers.pipeline("text-generation", model=offloaded, tokenizer=tokenizer, device=-1)("the cat", **kwargs)
    got = transformers.pipeline("text-generation", model=offloaded, tokenizer=tokenizer, device="cpu")("the cat", **kwargs)
    assert got == transformers.pipeline("text-generation", model=resident, tokenizer=tokenizer)("the cat", **kwargs)
