"""load() of a checkpoint taken in another setting reads what this optimizer uses and checks only that: a
checkpoint of bf16 parameters loads into the same model in fp32 (its masters are not used), an AdamW checkpoint
into Lion (its exp_avg_sq is not used), exactly as load_state_dict() of the same state does."""
import pytest
import torch

from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, make_opt, make_params, snapshot, train


def _saved(kind, dtype, state_dtype, tmp_path):
    params = make_params(dtype=dtype)
    opt = make_opt(kind, params, "cpu", tmp_path, state_dtype)
    train(opt, params, 1, 2)
    opt.save(tmp_path / "ckpt")
    sd = opt.state_dict()
    opt.close()
    return tmp_path / "ckpt", sd


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("case", ["bf16 params into fp32", "adamw into lion"])
def test_load_matches_load_state_dict_of_the_same_state(case, mode, state_dtype, tmp_path):
    if case == "bf16 params into fp32":
        ckpt, sd = _saved("adamw", torch.bfloat16, state_dtype, tmp_path)
        kind = "adamw"
    else:
        ckpt, sd = _saved("adamw", torch.float32, state_dtype, tmp_path)
        kind = "lion"
    a_params, b_params = make_params(seed=7), make_params(seed=7)
    a = make_opt(kind, a_params, mode, tmp_path, state_dtype)
    b = make_opt(kind, b_params, "cpu", tmp_path, state_dtype)
    a.load(ckpt)
    b.load_state_dict(sd)
    assert_same(snapshot(a, a_params), snapshot(b, b_params))
    train(a, a_params, 3, 4)
    train(b, b_params, 3, 4)
    assert_same(snapshot(a, a_params), snapshot(b, b_params))
    a.close()
    b.close()
