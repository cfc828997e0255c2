"""opt.load(dir) of a checkpoint that does not fit this optimizer, or of something else in the checkpoint file's
place: a ValueError naming the file (and both optimizer classes where they differ), the optimizer left as it
was; what save() writes loads back (a tensor lr, in either mode)."""
import os
import threading

import pytest
import torch

import swapio
from swapio.optim import checkpoint
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, make_opt, make_params, snapshot, train


def _saved(kind, tmp_path, mode="cpu", state_dtype="fp32", **hyper):
    params = make_params()
    if hyper:
        opt = {"adamw": swapio.optim.OffloadAdamW, "lion": swapio.optim.OffloadLion}[kind](params, **hyper)
    else:
        opt = make_opt(kind, params, mode, tmp_path, state_dtype)
    train(opt, params, 1, 2)
    opt.save(tmp_path / "ckpt")
    opt.close()
    return tmp_path / "ckpt"


def _refused(opt, params, ckpt, *named):
    before = snapshot(opt, params)
    with pytest.raises(ValueError) as info:
        opt.load(ckpt)
    for text in (checkpoint.FILE,) + named:
        assert text in str(info.value), (text, str(info.value))
    assert_same(snapshot(opt, params), before)
    return str(info.value)


def test_a_lion_checkpoint_into_adamw_names_the_file_and_both_classes(tmp_path):
    ckpt = _saved("lion", tmp_path)
    params = make_params()
    opt = make_opt("adamw", params, "cpu", tmp_path)
    train(opt, params, 1, 1)
    _refused(opt, params, ckpt, "lacks ['eps']", "OffloadLion", "OffloadAdamW")
    opt.close()


@pytest.mark.parametrize("saved, loader", [("adamw", "adam"), ("adam", "adamw")])
def test_adam_and_adamw_checkpoints_load_into_each_other(saved, loader, tmp_path):
    # one update rule: not refused; load() gives what load_state_dict() of the same state gives (AdamW forces
    # decoupled weight decay on its groups, as torch.optim.AdamW does)
    params = make_params()
    src = make_opt(saved, params, "cpu", tmp_path)
    train(src, params, 1, 2)
    src.save(tmp_path / "ckpt")
    sd = src.state_dict()
    a_params, b_params = make_params(seed=3), make_params(seed=3)
    a, b = make_opt(loader, a_params, "cpu", tmp_path), make_opt(loader, b_params, "cpu", tmp_path)
    a.load(tmp_path / "ckpt")
    b.load_state_dict(sd)
    train(a, a_params, 3, 4)
    train(b, b_params, 3, 4)
    assert_same(snapshot(a, a_params), snapshot(b, b_params))
    for opt in (src, a, b):
        opt.close()


def test_a_checkpoint_of_another_group_count_names_the_file(tmp_path):
    ckpt = _saved("adamw", tmp_path)
    params = make_params()
    opt = swapio.optim.OffloadAdamW([{"params": params[:2]}, {"params": params[2:]}])
    _refused(opt, params, ckpt, "different number of parameter groups")
    opt.close()


def test_an_amsgrad_checkpoint_into_int8_state_names_the_file(tmp_path):
    ckpt = _saved("adamw", tmp_path, amsgrad=True)
    params = make_params()
    opt = make_opt("adamw", params, "cpu", tmp_path, "int8")
    train(opt, params, 1, 1)
    _refused(opt, params, ckpt, "amsgrad")
    opt.close()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_forged_flag_is_a_value_error_naming_the_file(value, tmp_path):
    ckpt = _saved("adamw", tmp_path)
    state = swapio.checkpoint.load(ckpt / checkpoint.FILE)
    state["param_groups"][0]["amsgrad"] = value
    swapio.checkpoint.save(state, ckpt / checkpoint.FILE)
    params = make_params()
    opt = make_opt("adamw", params, "cpu", tmp_path)
    train(opt, params, 1, 1)
    _refused(opt, params, ckpt, "'amsgrad' must be a bool")
    opt.close()


def test_a_directory_in_place_of_the_checkpoint_file_is_named_as_such(tmp_path):
    (tmp_path / "ckpt" / checkpoint.FILE).mkdir(parents=True)
    params = make_params()
    opt = make_opt("adamw", params, "cpu", tmp_path)
    assert "is a directory" in _refused(opt, params, tmp_path / "ckpt")
    opt.close()


def test_a_fifo_in_place_of_the_checkpoint_file_is_named_and_does_not_block(tmp_path):
    (tmp_path / "ckpt").mkdir()
    os.mkfifo(tmp_path / "ckpt" / checkpoint.FILE)
    params = make_params()
    opt = make_opt("adamw", params, "cpu", tmp_path)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_refused(opt, params, tmp_path / "ckpt")), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "opt.load() blocked on a FIFO named swapio-optim.safetensors"
    assert outcome and "is a FIFO" in outcome[0]
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_a_tensor_lr_round_trips_as_a_tensor(mode, tmp_path):
    params = make_params()
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    opt = swapio.optim.OffloadAdamW(params, lr=torch.tensor(0.01), offload=mode, **extra)
    train(opt, params, 1, 2)
    opt.save(tmp_path / "ckpt")
    other_params = [p.detach().clone().requires_grad_(True) for p in params]
    other = swapio.optim.OffloadAdamW(other_params, lr=1e-3, offload=mode, **extra)
    other.load(tmp_path / "ckpt")
    lr = other.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and float(lr) == pytest.approx(0.01)
    train(opt, params, 3, 3)
    train(other, other_params, 3, 3)
    assert_same({**snapshot(other, other_params), "groups": []}, {**snapshot(opt, params), "groups": []})
    opt.close()
    other.close()
