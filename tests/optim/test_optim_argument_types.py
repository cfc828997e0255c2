"""Arguments of the wrong kind get a TypeError/ValueError naming them, before anything changes: they raised
errors from deep inside (AttributeError, KeyError, "unsupported operand type(s)") or none of the argument."""
import json

import pytest
import torch

swapio = pytest.importorskip("swapio")


def _stepped():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    return model, opt


@pytest.mark.parametrize("state_dict", [None, [], "state"], ids=repr)
def test_load_state_dict_of_a_non_dict_is_a_type_error(state_dict):
    # (None: torch's AttributeError "'NoneType' object has no attribute 'copy'")
    _, opt = _stepped()
    opt.step()
    before = opt.state_dict()
    with pytest.raises(TypeError, match="load_state_dict takes a state dict"):
        opt.load_state_dict(state_dict)
    after = opt.state_dict()
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())
    opt.close()


@pytest.mark.parametrize("max_norm", ["1.0", None, [1.0]], ids=repr)
def test_clip_grad_norm_max_norm_must_be_a_number(max_norm):
    model, opt = _stepped()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="max_norm must be a number"):
        opt.clip_grad_norm_(max_norm)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # not scaled
    opt.close()


@pytest.mark.parametrize("content, error, match", [
    (None, TypeError, "io_config must be a str or os.PathLike, got int"),
    ([4096], ValueError, "must be a JSON object"),
    ("{not json", ValueError, "is not valid JSON"),
], ids=["an int", "a JSON list", "not JSON"])
def test_io_config_is_checked_as_aiohandle_from_config_checks_it(tmp_path, content, error, match):
    # (an int: "expected str, bytes or os.PathLike object, not int"; a list: AttributeError; bad JSON: json's
    # own JSONDecodeError, not naming the file)
    config = 3
    if content is not None:
        config = tmp_path / "tune.json"
        config.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(error, match=match):
        swapio.optim.OffloadAdamW(torch.nn.Linear(2, 2).parameters(), io_config=config)


def test_state_bytes_per_element_of_an_unknown_dtype_is_a_value_error():
    # (a KeyError)
    assert swapio.quant.state_bytes_per_element("bf16") == 2.0
    with pytest.raises(ValueError, match=r"state_dtype must be one of \['fp32', 'bf16', 'int8'\], got 'fp16'"):
        swapio.quant.state_bytes_per_element("fp16")
