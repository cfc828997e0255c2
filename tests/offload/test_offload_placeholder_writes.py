"""A change in place to an offloaded weight between forwards (torch.nn.init, copy_, add_ under no_grad, or through
`.data`) lands on swapio's meta placeholder, a no-op that used to go unnoticed: the model went on computing with
the old weight. The next forward (or remove_offload) now raises a RuntimeError naming the weight, once; the
weight is as it was (outputs equal the resident model's). Assigning `.data` a tensor with values is refused at
once, before anything changed."""
import copy

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)).eval()


def offload(how, model, tmp_path, **kwargs):
    if how == "disk":
        return disk_offload(model, tmp_path / "od", buffer_bytes=16 << 10, **kwargs)
    return cpu_offload(model, **kwargs)


WRITES = {
    "init.normal_": lambda w: torch.nn.init.normal_(w),
    "copy_": lambda w: w.copy_(torch.ones(w.shape)),
    "add_": lambda w: w.add_(1.0),
    "zero_": lambda w: w.zero_(),
    "data.add_": lambda w: w.data.add_(1.0),
    "data +=": lambda w: setattr(w, "data", w.data.__iadd__(torch.ones(w.shape))),  # `w.data += x`, spelled out
    "data.copy_": lambda w: w.data.copy_(torch.ones(w.shape)),
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_write_to_a_placeholder_raises_at_the_next_forward(tmp_path, how, write):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    assert torch.equal(model(x), reference(x))
    with torch.no_grad():
        WRITES[write](model[2].weight)
    with pytest.raises(RuntimeError, match=r"(?s)^2\.weight is offloaded by swapio and was changed in place.*lost"):
        model(x)
    assert torch.equal(model(x), reference(x))  # said once; the weight is as it was
    remove_offload(model)
    assert torch.equal(model[2].weight, reference[2].weight)


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_write_before_remove_offload_raises_there(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    with torch.no_grad():
        model[0].weight.mul_(2)
    with pytest.raises(RuntimeError, match=r"0\.weight is offloaded by swapio"):
        remove_offload(model)
    remove_offload(model)  # still offloaded after the error; now it goes
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_offloaded_buffer_written_in_place_raises(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path, offload_buffers=True)
    model[1].running_mean.add_(1.0)
    with pytest.raises(RuntimeError, match=r"1\.running_mean is offloaded by swapio"):
        model(x)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_assigning_data_with_values_is_refused_at_once(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    with pytest.raises(RuntimeError, match=r"offloaded by swapio.*\(3, 8\) torch\.float32 on cpu"):
        model[2].weight.data = torch.zeros(3, 8)
    assert model[2].weight.device.type == "meta"
    assert torch.equal(model(x), reference(x))
    model.float()  # torch's _apply assigns each placeholder's .data to itself: allowed
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_write_before_save_checkpoint_raises_there(tmp_path, how):
    """save_checkpoint writes the stored weights: a change that was lost is said, not saved as if made."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    with torch.no_grad():
        torch.nn.init.zeros_(model[0].weight)
    with pytest.raises(RuntimeError, match=r"0\.weight is offloaded by swapio"):
        save_checkpoint(model, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()
    save_checkpoint(model, tmp_path / "a.safetensors")
    saved = safetensors_torch.load_file(str(tmp_path / "a.safetensors"))
    assert torch.equal(saved["0.weight"], reference[0].weight.detach())


def wrapped(model):
    """The offloaded model put under a module outside it (as peft's wrappers do): until its next forward, its
    weights show stand-ins (one expanded NaN element on the execution device) instead of the placeholders."""
    outer = torch.nn.Module()
    outer.inner = model
    return outer


@pytest.mark.parametrize("write", ["fill_", "zero_", "ones_"])
@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_write_to_a_stand_in_raises_at_the_next_forward(tmp_path, how, write):
    """The writes a stand-in's single element lets through (the others raise torch's own error at once)."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    wrapped(model)
    assert model[2].weight.device.type == "cpu" and model[2].weight.stride() == (0, 0)  # a stand-in
    with torch.no_grad():
        {"fill_": lambda w: w.fill_(2.0), "zero_": lambda w: w.zero_(),
         "ones_": lambda w: torch.nn.init.ones_(w)}[write](model[2].weight)
    with pytest.raises(RuntimeError, match=r"2\.weight is offloaded by swapio and was changed in place"):
        model(x)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_assigning_a_stand_in_data_is_refused_at_once(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    wrapped(model)
    with pytest.raises(RuntimeError, match=r"offloaded by swapio.*would not change the weight"):
        model[2].weight.data = torch.zeros(3, 8)
    model.float()  # _apply assigns each stand-in's .data to itself: allowed
    assert torch.equal(model(x), reference(x))


REPLACEMENTS = {
    "setattr Parameter": lambda m: setattr(m[2], "weight", torch.nn.Parameter(torch.zeros(3, 8))),
    "_parameters item": lambda m: m[2]._parameters.__setitem__("weight", torch.nn.Parameter(torch.zeros(3, 8))),
    "set_module_tensor_to_device": lambda m: pytest.importorskip("accelerate.utils").set_module_tensor_to_device(
        m, "2.weight", "cpu", value=torch.zeros(3, 8)),
}


@pytest.mark.parametrize("replace", sorted(REPLACEMENTS))
@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_weight_replaced_between_forwards_raises_at_the_next_forward(tmp_path, how, replace):
    """A new tensor assigned to an offloaded attribute was dropped by the next forward (which puts fetched weights,
    then the placeholder, in the attribute): the model computed with the old weight, without a word."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    REPLACEMENTS[replace](model)
    with pytest.raises(RuntimeError, match=r"(?s)^2\.weight is offloaded by swapio and was replaced between forwards"):
        model(x)
    assert model[2].weight.device.type == "meta"  # said once; the weight is as it was
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_weight_replaced_before_remove_offload_or_save_checkpoint_raises_there(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    model[0].weight = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(RuntimeError, match=r"0\.weight is offloaded by swapio and was replaced"):
        save_checkpoint(model, tmp_path / "a.safetensors")
    model[0].bias = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(RuntimeError, match=r"0\.bias is offloaded by swapio and was replaced"):
        remove_offload(model)
    remove_offload(model)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_parameter_made_of_a_placeholder_shares_its_version(tmp_path, how):
    """torch.nn.Parameter(weight) (what weight_norm, parametrize and libraries that rewrap a weight call) needs a
    Parameter subclass's detach() to keep its type: it raised torch's "requires that detach() returns an instance
    of the same type". Like a resident weight's, the new Parameter shares the weight: a change through it is said."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    p = torch.nn.Parameter(model[2].weight, requires_grad=False)
    resident = torch.nn.Parameter(reference[2].weight, requires_grad=False)
    assert isinstance(p, torch.nn.Parameter) and p.shape == resident.shape and not p.requires_grad
    assert torch.equal(model(x), reference(x))  # made, not changed: no error
    with torch.no_grad():
        p.add_(1.0)
    with pytest.raises(RuntimeError, match=r"2\.weight is offloaded by swapio and was changed in place"):
        model(x)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_weight_norm_on_an_offloaded_module_raises_at_each_forward(tmp_path, how):
    """weight_norm moves the weight out of the module's _parameters (into a parametrization computed from the meta
    placeholder): each forward says so, rather than computing with meta values after the first error."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path)
    torch.nn.utils.parametrizations.weight_norm(model[2])
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"2\.weight is offloaded by swapio and was taken out of its module"):
            model(x)
    torch.nn.utils.parametrize.remove_parametrizations(model[2], "weight")  # puts a (meta) Parameter back
    with pytest.raises(RuntimeError, match=r"2\.weight is offloaded by swapio and was replaced"):
        model(x)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_weight_replaced_under_a_preloaded_module_raises(tmp_path, how):
    """A preload module (preload_module_classes) brings its submodules' weights in itself: the same check."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path, preload_module_classes=["Sequential"])
    model[2].weight = torch.nn.Parameter(torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match=r"2\.weight is offloaded by swapio and was replaced"):
        model(x)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_functional_call_with_an_offloaded_weight_raises(tmp_path, how):
    """torch.func.functional_call puts the given tensors in the modules' attributes for the call: for an offloaded
    weight the forward streamed the stored one instead (silently the wrong result). Resident ones work as usual."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path, keep_resident=["2"])
    given = {"2.weight": torch.zeros(3, 8)}
    assert torch.equal(torch.func.functional_call(model, given, (x,)),
                       torch.func.functional_call(reference, given, (x,)))
    with pytest.raises(RuntimeError, match=r"0\.weight is offloaded by swapio and was replaced"):
        torch.func.functional_call(model, {"0.weight": torch.zeros(8, 4)}, (x,))
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_tie_weights_of_a_wrapped_model_with_an_output_bias(tmp_path, how):
    """transformers' tie_weights pads the output embedding's bias by nothing (`bias.data = pad(bias.data, (0, 0))`):
    on a stand-in (a model just wrapped, as by peft) that assignment of its own NaN values was refused."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(config).eval()
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    model = offload(how, copy.deepcopy(reference), tmp_path)
    wrapped(model)
    assert model.cls.predictions.decoder.bias.device.type == "cpu"  # a stand-in
    model.tie_weights()
    reference.tie_weights()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_offloaded_buffer_replaced_between_forwards_raises(tmp_path, how):
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference), tmp_path, offload_buffers=True)
    model[1].running_mean = torch.ones(8)
    with pytest.raises(RuntimeError, match=r"1\.running_mean is offloaded by swapio and was replaced"):
        model(x)
    assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_assigning_data_of_another_dtype_says_to_offload_in_that_dtype(tmp_path, how):
    """peft's prepare_model_for_kbit_training runs `param.data = param.data.to(torch.float32)` on fp16/bf16 weights:
    refused (the stored weights keep their dtype), saying so rather than only that the change would be lost."""
    reference, x = net(), torch.randn(2, 4)
    model = offload(how, copy.deepcopy(reference).to(torch.bfloat16), tmp_path)
    with pytest.raises(RuntimeError, match=r"stay torch\.bfloat16 in swapio's storage: offload the model in the "
                                           r"dtype wanted.*prepare_model_for_kbit_training"):
        model[2].weight.data = model[2].weight.data.to(torch.float32)
    assert model[2].weight.dtype == torch.bfloat16
    assert torch.equal(model(x.bfloat16()), reference.to(torch.bfloat16)(x.bfloat16()))
