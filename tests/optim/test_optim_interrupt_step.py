"""Ctrl-C inside step(): every parameter ends either fully stepped (values, moments and count advanced) or
untouched, so retrying the step for the untouched ones continues bit-identically to a run never interrupted
(cpu and nvme, every state_dtype, Adam and Lion). Ctrl-C is a real SIGINT sent from inside the step's machinery
(the kernel call, a read or a write of the swap file), as a user's would land there."""
import os

import pytest
import torch

import swapio
from swapio import ops
from helpers.ctrl_c import ctrl_c_on_call, ctrl_c_on_swap_io
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, assert_trains_like_fresh, make_opt, make_params, set_grads, snapshot, train


pytestmark = pytest.mark.usefixtures("ctrl_c_raises")  # real SIGINTs raise even under an ignoring runner


KERNEL_POINTS = [("kernel", 0), ("kernel", 2), ("kernel", 4), ("after_kernel", 1), ("after_kernel", 4)]
SWAP_POINTS = [("pread", 1), ("pwrite", 0), ("pwrite", 3)]  # nvme mode only
CASES = [("cpu", *p) for p in KERNEL_POINTS] + [("nvme", *p) for p in KERNEL_POINTS + SWAP_POINTS]


def _interrupted_run(kind, mode, state_dtype, point, at, how, tmp_path, monkeypatch):
    params = make_params()
    opt = make_opt(kind, params, mode, tmp_path, state_dtype)
    train(opt, params, 1, 2)
    before = snapshot(opt, params)
    kernel = "lion_step_" if kind == "lion" else "adam_step_"
    if point in ("kernel", "after_kernel"):
        ctrl_c_on_call(monkeypatch, ops, kernel, at, how, after=point == "after_kernel")
    else:
        ctrl_c_on_swap_io(opt, monkeypatch, point, at)
    set_grads(params, 3)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    return opt, params, before


def _check_resume(kind, mode, state_dtype, opt, params, before, tmp_path):
    ref_params = make_params()
    ref = make_opt(kind, ref_params, "cpu", tmp_path, state_dtype)
    train(ref, ref_params, 1, 3)
    stepped = snapshot(ref, ref_params)
    now = snapshot(opt, params)
    untouched = []
    for i in range(len(params)):
        count = now["state"][i]["step"].item()
        expected = {2.0: before, 3.0: stepped}.get(count)
        assert expected is not None, f"parameter {i} has step {count}"
        assert torch.equal(now["params"][i], expected["params"][i]), (i, count)
        for name, t in now["state"][i].items():
            assert torch.equal(t, expected["state"][i][name]), (i, count, name)
        if count == 2.0:
            untouched.append(i)
    set_grads(params, 3, only=untouched)  # the step again, for the parameters it did not reach
    opt.step()
    train(opt, params, 4, 5)
    train(ref, ref_params, 4, 5)
    assert_same(snapshot(opt, params), snapshot(ref, ref_params))
    opt.close()
    ref.close()
    return untouched


@pytest.mark.parametrize("mode, point, at", CASES)
def test_ctrl_c_in_step_leaves_each_parameter_stepped_or_untouched(mode, point, at, tmp_path, monkeypatch):
    opt, params, before = _interrupted_run("adamw", mode, "fp32", point, at, "signal", tmp_path, monkeypatch)
    untouched = _check_resume("adamw", mode, "fp32", opt, params, before, tmp_path)
    assert len(untouched) < len(params)  # Ctrl-C took effect before the end of the step


@pytest.mark.parametrize("kind", ["adam", "lion"])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_ctrl_c_in_step_with_small_state(kind, state_dtype, mode, tmp_path, monkeypatch):
    opt, params, before = _interrupted_run(kind, mode, state_dtype, "kernel", 2, "signal", tmp_path, monkeypatch)
    _check_resume(kind, mode, state_dtype, opt, params, before, tmp_path)


@pytest.mark.parametrize("at", [0, 1, 4])
def test_exception_from_the_kernel_leaves_each_parameter_stepped_or_untouched(at, tmp_path, monkeypatch):
    """An exception raised in place of a kernel call (cpu mode, one call a parameter) stops the step there."""
    opt, params, before = _interrupted_run("adamw", "cpu", "fp32", "kernel", at, "raise", tmp_path, monkeypatch)
    assert _check_resume("adamw", "cpu", "fp32", opt, params, before, tmp_path) == list(range(at, len(params)))


def test_a_parameter_torn_by_an_io_error_refuses_use_until_a_checkpoint_is_loaded(tmp_path, monkeypatch):
    """An I/O error between two chunks of a parameter that spans several (nvme) leaves it half-stepped: the
    optimizer then refuses to step, export or save until a checkpoint is loaded, rather than spread the damage."""
    import errno

    params = make_params()
    opt = make_opt("adamw", params, "nvme", tmp_path)
    train(opt, params, 1, 2)
    opt.save(tmp_path / "ckpt")
    before = [p.detach().clone() for p in params]
    real, calls = swapio.AioHandle.pread, {"n": 0}

    def pread(self, tensor, path, offset=0, **kw):
        if os.path.dirname(os.fspath(path)) == opt.swap_path:
            calls["n"] += 1
            if calls["n"] == 3:  # the third chunk's read: the first chunk, where parameter 2 starts, is done
                raise OSError(errno.EIO, "injected read error", os.fspath(path))
        return real(self, tensor, path, offset, **kw)

    monkeypatch.setattr(swapio.AioHandle, "pread", pread)
    set_grads(params, 3)
    with pytest.raises(OSError, match="injected"):
        opt.step()
    monkeypatch.undo()
    assert [opt.state[p]["step"].item() for p in params] == [3.0, 3.0, 2.0, 2.0, 2.0]
    for use in (opt.step, opt.state_dict, lambda: opt.save(tmp_path / "other")):
        with pytest.raises(RuntimeError, match=r"parameter\(s\) \[2\].*half-stepped"):
            use()
    with torch.no_grad():  # the model's weights from its checkpoint, the optimizer's from its own
        for p, b in zip(params, before):
            p.copy_(b)
    opt.load(tmp_path / "ckpt")
    assert_trains_like_fresh(opt, params, 3, 5, tmp_path)
    opt.close()
