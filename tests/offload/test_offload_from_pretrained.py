"""swapio.offload.from_pretrained(model class or config, save_pretrained directory): built on meta and offloaded
from the checkpoint in one call, it gives exactly what transformers' own from_pretrained of the same directory
gives (logits and greedy tokens), for four architectures."""
import sys

import pytest
import torch

from swapio.offload import from_pretrained, stats
from swapio.offload.api import _offloaded
from helpers import hf_tiny

transformers = hf_tiny.transformers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(name, sharded=False):
        if (name, sharded) not in cache:
            directory = tmp_path_factory.mktemp(name)
            hf_tiny.save(name, directory, sharded)
            reference = hf_tiny.arch(name)[1].from_pretrained(directory).eval()
            cache[name, sharded] = directory, hf_tiny.run(reference)
        return cache[name, sharded]
    return get


def assert_same(model, want):
    got = hf_tiny.run(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("name", sorted(hf_tiny.ARCHS))
def test_model_class_and_directory(saved, name):
    directory, want = saved(name, sharded=name == "qwen2")  # sharded checkpoints: test_offload_meta_models.py
    model = from_pretrained(hf_tiny.arch(name)[1], directory, buffer_bytes=16 << 10)
    assert not model.training
    assert all(p.device.type == "meta" for p in model.parameters())  # offloaded: placeholders between forwards
    assert_same(model, want)
    assert stats(model)["bytes_read"] > 0


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_config_and_auto_class(saved, name):
    directory, want = saved(name)
    assert_same(from_pretrained(transformers.AutoConfig.from_pretrained(directory), directory), want)
    auto = transformers.AutoModelForSeq2SeqLM if name == "t5" else transformers.AutoModelForCausalLM
    assert_same(from_pretrained(auto, directory, prefetch=1), want)


def test_bf16_checkpoint_gives_a_bf16_model(tmp_path):
    model = hf_tiny.resident("qwen2").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    want = hf_tiny.run(transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval())
    got = from_pretrained(transformers.Qwen2ForCausalLM, tmp_path)
    assert got.dtype == torch.bfloat16
    assert_same(got, want)


def test_dtype_auto_and_a_dtype_it_cannot_serve(tmp_path):
    hf_tiny.resident("qwen2").to(torch.bfloat16).save_pretrained(tmp_path)
    assert from_pretrained(transformers.Qwen2ForCausalLM, tmp_path, dtype="auto").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="without converting"):
        from_pretrained(transformers.Qwen2ForCausalLM, tmp_path, dtype=torch.float32)
    # a dtype's name, as transformers takes it (torch_dtype="bfloat16" in configs and scripts): it was a TypeError
    assert from_pretrained(transformers.Qwen2ForCausalLM, tmp_path, torch_dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="without converting"):
        from_pretrained(transformers.Qwen2ForCausalLM, tmp_path, dtype="float16")
    for not_a_dtype in ("fp16", "Tensor", 16):
        with pytest.raises(TypeError, match="dtype must be a torch.dtype, its name"):
            from_pretrained(transformers.Qwen2ForCausalLM, tmp_path, dtype=not_a_dtype)


def test_bad_arguments_are_clear_errors(saved, tmp_path):
    directory, _ = saved("llama")
    with pytest.raises(TypeError, match="transformers model class .* or a transformers config"):
        from_pretrained(torch.nn.Linear, directory)
    with pytest.raises(TypeError, match="checkpoint= is not an argument"):
        from_pretrained(transformers.LlamaForCausalLM, directory, checkpoint=directory)
    with pytest.raises(ValueError, match="is not a directory"):
        from_pretrained(transformers.LlamaForCausalLM, tmp_path / "nothing")


def test_transformers_missing_is_a_clear_error(saved, monkeypatch):
    directory, _ = saved("llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(ImportError, match="needs transformers"):
        from_pretrained("LlamaForCausalLM", directory)


def test_config_naming_an_unknown_class_is_a_clear_error(saved):
    directory, _ = saved("llama")
    config = transformers.AutoConfig.from_pretrained(directory)
    config.architectures = ["NoSuchModelForCausalLM"]
    with pytest.raises(ValueError, match="names 'NoSuchModelForCausalLM', which this transformers does not have"):
        from_pretrained(config, directory)


def test_transformers_from_pretrained_arguments(saved):
    """What users pass to transformers' from_pretrained works here too, or names this function."""
    directory, want = saved("llama")
    cls = hf_tiny.arch("llama")[1]
    auto = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for kwargs, device in (({"torch_dtype": torch.float32, "device_map": "auto"}, auto),
                           ({"torch_dtype": "auto"}, "cpu"), ({"device_map": "cpu", "low_cpu_mem_usage": True}, "cpu"),
                           ({"device_map": {"": "cpu"}}, "cpu"), ({"device_map": torch.device("cpu")}, "cpu")):
        model = from_pretrained(cls, directory, **kwargs)
        assert model.dtype == torch.float32 and _offloaded[model].device == torch.device(device), kwargs
        if torch.device(device).type == "cpu":
            assert_same(model, want)
    with pytest.raises(ValueError, match="without converting"):
        from_pretrained(cls, directory, torch_dtype=torch.float16)
    with pytest.raises(TypeError, match="dtype= or torch_dtype="):
        from_pretrained(cls, directory, dtype=torch.float32, torch_dtype=torch.float32)
    with pytest.raises(ValueError, match="one execution device.*keep_resident"):
        from_pretrained(cls, directory, device_map={"model.embed_tokens": "cpu", "model.layers": "disk"})
    with pytest.raises(TypeError, match="device_map= or execution_device="):
        from_pretrained(cls, directory, device_map="cpu", execution_device="cpu")
    with pytest.raises(TypeError, match=r"swapio.offload.from_pretrained\(\) got an unexpected keyword argument "
                                        r"'trust_remote_code'"):
        from_pretrained(cls, directory, trust_remote_code=True)


def test_config_settings_go_through_a_config(saved):
    """transformers' from_pretrained takes config settings as keywords (attn_implementation="eager"); ours refuses
    them with a TypeError that shows the config route, and that route builds what transformers builds."""
    directory, _ = saved("llama")
    with pytest.raises(TypeError, match=r"attn_implementation.*AutoConfig\.from_pretrained\(checkpoint_dir, "
                                        r"attn_implementation=\.\.\.\)"):
        from_pretrained(transformers.AutoModelForCausalLM, directory, attn_implementation="eager")
    config = transformers.AutoConfig.from_pretrained(directory, attn_implementation="eager")
    model = from_pretrained(config, directory)
    want = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert model.config._attn_implementation == want.config._attn_implementation == "eager"
    assert_same(model, hf_tiny.run(want))


def test_offload_dir_trains_like_resident_and_never_writes_the_checkpoint(saved, tmp_path):
    """from_pretrained(..., offload_dir=...): the weights an optimizer trains are written there (without it,
    building the optimizer is a ValueError); losses and weights as the resident model trained the same way."""
    import hashlib
    from swapio.optim import OffloadAdamW
    directory, _ = saved("llama")
    files = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}
    ids = hf_tiny.inputs()

    def train(model):
        losses = []
        with OffloadAdamW(model.parameters(), lr=1e-2) as opt, hf_tiny.one_thread():
            model.train()
            for _ in range(3):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    want = train(transformers.LlamaForCausalLM.from_pretrained(directory))
    with pytest.raises(ValueError, match="offload_dir"):
        OffloadAdamW(from_pretrained(transformers.LlamaForCausalLM, directory).parameters(), lr=1e-2)
    model = from_pretrained(transformers.LlamaForCausalLM, directory, offload_dir=tmp_path / "od")
    assert train(model) == want
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()} == files
