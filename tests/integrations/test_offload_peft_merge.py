"""peft's merge_and_unload(), merge_adapter(), unmerge_adapter() and unload() on an offloaded base model: the
merged model computes exactly what the resident reference's merged model computes (same LoRA setup, same
arithmetic: peft adds the delta to the weight on the CPU in both), the offloaded model serves the merged weights
afterwards (remove_offload and save_pretrained give them back), and where swapio cannot write the weights (a
checkpoint read in place, a weight a swapio optimizer trains) every path raises before anything changed."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, from_pretrained, remove_offload
from helpers import hf_tiny

peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

HOWS = ["cpu", "disk-dir", "checkpoint+dir", "from_pretrained+dir", "offload-peft-model"]


def targets(name):
    return ["q", "v"] if name == "t5" else ["q_proj", "v_proj", "down_proj"]


def add_lora(model, name):
    """LoRA with nonzero B (a fresh adapter's delta is zero: merging it would change nothing)."""
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets(name)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return model


def logits(model):
    return hf_tiny.run(model)[0]


def offloaded(name, how, directory, tmp_path):
    """A peft model over an offloaded base, built in the way `how` names."""
    if how == "cpu":
        return add_lora(cpu_offload(hf_tiny.resident(name)), name)
    if how == "disk-dir":
        return add_lora(disk_offload(hf_tiny.resident(name), offload_dir=tmp_path / "od", buffer_bytes=16 << 10), name)
    if how == "from_pretrained+dir":  # the transformers entry point, merged weights written to offload_dir
        return add_lora(from_pretrained(hf_tiny.arch(name)[1], directory, offload_dir=tmp_path / "od",
                                        buffer_bytes=16 << 10), name)
    if how == "checkpoint+dir":
        model = disk_offload(hf_tiny.build_empty(name, "meta"), checkpoint=directory, offload_dir=tmp_path / "od",
                             buffer_bytes=16 << 10)  # read from the checkpoint, written (merged) to offload_dir
        return add_lora(model, name)
    model = add_lora(hf_tiny.resident(name), name)  # offloading a peft model: its base layers are wrapped already
    disk_offload(model, offload_dir=tmp_path / "od", buffer_bytes=16 << 10)
    return model


def weights(model):
    """The model's weights as resident tensors (the model stays as it is)."""
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name in ("llama", "t5"):
        directory = tmp_path_factory.mktemp(name)
        hf_tiny.save(name, directory)
        out[name] = directory
    return out


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize("how", HOWS)
def test_merge_and_unload_like_resident(saved, tmp_path, name, how):
    ref = add_lora(hf_tiny.resident(name), name)
    model = offloaded(name, how, saved[name], tmp_path)
    assert torch.equal(logits(model), logits(ref))  # a forward first: placeholders, not stand-ins, in place
    want = ref.merge_and_unload()
    merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert torch.equal(logits(merged), logits(want))
    expected = weights(want)
    # streams the weights the offloaded model serves; where that is the peft model, merged is a part of it (its
    # save_pretrained was transformers' own: "... is offloaded by swapio: the model's state_dict() holds a
    # placeholder")
    out = tmp_path / "saved"
    merged.save_pretrained(out)
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(safetensors_torch.load_file(str(f)))
    assert written and set(written) <= set(expected)  # tied aliases written once
    for k, v in written.items():
        assert torch.equal(v, expected[k]), k
    remove_offload(model.base_model.model if how != "offload-peft-model" else model)
    assert not any("_hf_hook" in m.__dict__ for m in model.modules())  # swapio's hooks went with the offload
    got = weights(merged)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("how", HOWS)
def test_merge_adapter_then_unmerge_like_resident(saved, tmp_path, how):
    ref = add_lora(hf_tiny.resident("llama"), "llama")
    model = offloaded("llama", how, saved["llama"], tmp_path)
    ref.merge_adapter()
    model.merge_adapter()  # before any forward: the base layers show stand-ins until then
    assert torch.equal(logits(model), logits(ref))  # the merged base layers alone compute (peft skips the adapters)
    ref.unmerge_adapter()
    model.unmerge_adapter()
    assert torch.equal(logits(model), logits(ref))
    with ref.disable_adapter(), model.disable_adapter():  # the base layers alone: the delta was taken out again
        assert torch.equal(logits(model), logits(ref))


@pytest.mark.parametrize("how", ["cpu", "disk-dir"])
def test_merge_after_training_the_adapters_offloaded(tmp_path, how):
    """A LoRA training step on the offloaded model (backward refetches the base weights), then the merge."""
    def train(model):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        ids = hf_tiny.inputs()
        with hf_tiny.one_thread():
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            model.eval()
        return model.merge_and_unload()

    want = train(add_lora(hf_tiny.resident("llama"), "llama"))
    got = train(offloaded("llama", how, None, tmp_path))
    assert torch.equal(logits(got), logits(want))


@pytest.mark.parametrize("how", HOWS)
def test_unload_keeps_the_base_weights(saved, tmp_path, how):
    base = logits(hf_tiny.resident("llama"))
    model = offloaded("llama", how, saved["llama"], tmp_path)
    logits(model)
    unloaded = model.unload()
    assert not any("lora_" in n for n, _ in unloaded.named_parameters())
    assert torch.equal(logits(unloaded), base)


@pytest.mark.parametrize("call", ["merge_and_unload", "merge_adapter", "unload"])
@pytest.mark.parametrize("forward_first", [True, False])
def test_checkpoint_read_in_place_refuses_before_changing_anything(saved, call, forward_first):
    """from_pretrained without offload_dir reads the checkpoint in place and never writes it: nowhere to put
    merged weights. Refused (unload() too: swapio cannot tell it from a merge when peft brings a layer in)."""
    _, cls = hf_tiny.arch("llama")
    model = add_lora(from_pretrained(cls, saved["llama"]), "llama")
    want = logits(add_lora(hf_tiny.resident("llama"), "llama"))
    if forward_first:
        assert torch.equal(logits(model), want)
    with pytest.raises(ValueError, match=r"(?s)read in place from a checkpoint.*offload_dir=.*save_pretrained"):
        getattr(model, call)()
    assert sum("lora_" in n for n, _ in model.named_parameters()) > 0
    assert torch.equal(logits(model), want)  # the peft model as it was


def test_weight_trained_by_a_swapio_optimizer_refuses_merging(tmp_path):
    """A weight an offloaded optimizer trains has its fp32 master there: a merge written under it would be
    overwritten by the next step. Refused, before anything changed."""
    optim = pytest.importorskip("swapio.optim")
    ref = add_lora(hf_tiny.resident("llama"), "llama")
    model = add_lora(disk_offload(hf_tiny.resident("llama"), offload_dir=tmp_path / "od", buffer_bytes=16 << 10),
                     "llama")
    logits(model)  # the placeholders back in place of the stand-ins: what the optimizer takes
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    q.requires_grad_(True)  # the base weight trained too, by swapio's optimizer
    opt = optim.OffloadAdamW([q], lr=0.0)
    with pytest.raises(RuntimeError, match=r"(?s)q_proj.*swapio optimizer"):
        model.merge_and_unload()
    assert torch.equal(logits(model), logits(ref))
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_like_resident_in_bf16_and_with_safe_merge(tmp_path, dtype, safe_merge):
    """safe_merge assigns base_layer.weight.data a new tensor instead of adding in place; bf16 weights take an
    fp32 delta (peft's arithmetic, the same on both sides)."""
    ref = add_lora(hf_tiny.resident("llama").to(dtype), "llama")
    model = add_lora(disk_offload(hf_tiny.resident("llama").to(dtype), offload_dir=tmp_path / "od",
                                  buffer_bytes=16 << 10), "llama")
    want = ref.merge_and_unload(safe_merge=safe_merge)
    merged = model.merge_and_unload(safe_merge=safe_merge)
    assert torch.equal(logits(merged), logits(want))
    remove_offload(merged)
    expected = weights(want)
    for k, v in weights(merged).items():
        assert v.dtype == dtype and torch.equal(v, expected[k]), k


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_merged_model_run_with_adapters_disabled_says_to_unmerge_first(tmp_path, name):
    """peft unmerges a merged layer inside its forward when adapters are disabled, outside onload_layer: the
    subtraction lands on the placeholder, and the base layer's forward right after says so (it used to compute
    silently with the merged weight)."""
    model = offloaded(name, "cpu", None, tmp_path)
    model.merge_adapter()
    logits(model)
    with model.disable_adapter(), pytest.raises(RuntimeError, match=r"(?s)changed in place.*unmerge_adapter\(\)"):
        logits(model)


@pytest.mark.parametrize("how", ["cpu", "disk-dir"])
def test_accelerate_align_module_device_on_a_base_layer(tmp_path, how):
    """The hook speaks accelerate's protocol: align_module_device brings the weights in, a change made there is
    written back, as on a resident model changed in place."""
    from accelerate.utils import align_module_device, has_offloaded_params

    def q_proj(model):
        return model.base_model.model.model.layers[1].self_attn.q_proj.base_layer

    ref = add_lora(hf_tiny.resident("llama"), "llama")
    model = offloaded("llama", how, None, tmp_path)
    assert has_offloaded_params(q_proj(model))
    with torch.no_grad():
        q_proj(ref).weight.mul_(0.5)
        with align_module_device(q_proj(model)):
            assert q_proj(model).weight.device.type == "cpu"
            q_proj(model).weight.mul_(0.5)
    assert q_proj(model).weight.device.type == "meta"  # the placeholder back
    assert torch.equal(logits(model), logits(ref))


def test_merge_whose_write_fails_raises_and_is_never_served_half_done(tmp_path, monkeypatch):
    """The disk refuses the merged weights: merge_adapter raises the OSError, and the model does not silently
    compute with weights whose stored bytes are unknown (its next forward raises too)."""
    import errno
    from helpers.offload_training import fail_nth_write
    model = offloaded("llama", "disk-dir", None, tmp_path)
    logits(model)
    restore = fail_nth_write(monkeypatch, str(tmp_path / "od"), 1, "future", None)
    with pytest.raises(OSError) as info:
        model.merge_adapter()
    restore()
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        logits(model)
