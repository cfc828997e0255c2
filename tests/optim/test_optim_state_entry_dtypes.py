"""A moment put in optimizer.state[p] (cpu mode) in another dtype than this optimizer stores it, as torch users reset
one: `opt.state[p]["exp_avg"] = torch.zeros_like(p)` is bf16 for a bf16 model (torch keeps that model's state in
bf16). It made the kernel step that parameter with bf16 state (both moments replaced), or raise half way through a
step (one replaced), and save() wrote a checkpoint that load() refused (checksum mismatch). A floating tensor is
now stored as load_state_dict() stores the field (fp32 state: exactly; bf16 state: rounded to nearest); what has no
values or is not floating, or replaces int8 codes, is refused before anything is stepped or saved."""
import pytest
import torch

import swapio.optim as so
from helpers.optim import masters, one_thread, rel_diff  # noqa: F401


def _grads(k, params):
    gen = torch.Generator().manual_seed(100 + k)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _params(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_(True) for n in (40, 300, 50)]


def _step(opt, params, k):
    for p, g in zip(params, _grads(k, params)):
        p.grad = g.to(p.dtype)
    opt.step()


def _with_torch(dtype):
    """(params, fp32 copies of them, an OffloadAdamW in cpu mode over params, torch's AdamW over the copies)."""
    params = _params(dtype)
    ref = [p.detach().float().requires_grad_(True) for p in params]
    return params, ref, so.OffloadAdamW(params, lr=1e-2, offload="cpu"), torch.optim.AdamW(ref, lr=1e-2, foreach=False)


def _step_both(ours, theirs, params, ref, k):
    _step(ours, params, k)
    for q, p in zip(ref, params):
        q.grad = p.grad.float()
    theirs.step()


@pytest.mark.parametrize("both", [False, True], ids=["exp_avg", "both moments"])
def test_a_moment_reset_with_zeros_like_a_bf16_parameter_steps_as_torch(both, tmp_path):
    params, ref, ours, theirs = _with_torch(torch.bfloat16)
    for k in range(4):
        if k == 2:
            for name in ("exp_avg", "exp_avg_sq") if both else ("exp_avg",):
                ours.state[params[1]][name] = torch.zeros_like(params[1])  # bf16, torch's reset for this model
                theirs.state[ref[1]][name] = torch.zeros_like(ref[1])
        _step_both(ours, theirs, params, ref, k)
    for mine, q in zip(masters(ours, params), ref):
        assert rel_diff(mine, q) <= 1e-6
    assert all(ours.state[params[1]][name].dtype == torch.float32 for name in ("exp_avg", "exp_avg_sq"))
    ours.save(tmp_path / "ckpt")  # was written with the bf16 bytes under fp32 checksums: load() refused it
    expected = ours.state_dict()
    ours.load(tmp_path / "ckpt")
    for i, entry in expected["state"].items():
        for name, value in entry.items():
            assert torch.equal(ours.state_dict()["state"][i][name], value), (i, name)
    ours.close()


def test_an_fp32_moment_given_to_bf16_state_is_stored_as_load_state_dict_stores_it(tmp_path):
    params = _params(torch.float32)
    ours = so.OffloadAdamW(params, lr=1e-2, offload="cpu", state_dtype="bf16")
    twin = so.OffloadAdamW([p.detach().clone().requires_grad_(True) for p in params], lr=1e-2, offload="cpu",
                           state_dtype="bf16")
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for k in range(2):
        _step(ours, params, k)
        _step(twin, twin_params, k)
    moment = torch.randn(300, generator=torch.Generator().manual_seed(9))
    ours.state[params[1]]["exp_avg"] = moment.clone()
    sd = twin.state_dict()
    sd["state"][1]["exp_avg"] = moment.clone()
    twin.load_state_dict(sd)
    for k in range(2, 4):
        _step(ours, params, k)
        _step(twin, twin_params, k)
    assert ours.state[params[1]]["exp_avg"].dtype == torch.bfloat16
    for p, q in zip(params, twin_params):
        assert torch.equal(p.detach(), q.detach())
    ours.save(tmp_path / "ckpt")
    ours.load(tmp_path / "ckpt")
    ours.close()
    twin.close()


BAD = {
    "integer": (lambda p: torch.zeros(p.shape, dtype=torch.int32), "fp32"),
    "meta": (lambda p: torch.zeros_like(p, device="meta"), "fp32"),
    "floats for int8 codes": (lambda p: torch.zeros_like(p), "int8"),
    "a NumPy array": (lambda p: p.detach().numpy().copy(), "fp32"),  # (was a bare TypeError, or exported as is)
    "a list": (lambda p: p.tolist(), "fp32"),
}


@pytest.mark.parametrize("make, state_dtype", BAD.values(), ids=BAD.keys())
def test_a_moment_that_cannot_be_stored_is_refused_before_anything_is_stepped_or_saved(make, state_dtype, tmp_path):
    params = _params(torch.float32)
    opt = so.OffloadAdamW(params, lr=1e-2, offload="cpu", state_dtype=state_dtype)
    _step(opt, params, 0)
    opt.state[params[1]]["exp_avg"] = make(params[1])
    before = [p.detach().clone() for p in params]
    for call in (lambda: _step(opt, params, 1), opt.state_dict, lambda: opt.save(tmp_path / "ckpt")):
        with pytest.raises(RuntimeError, match=r"parameter 1 .*'exp_avg'.*del opt.state\[p\]"):
            call()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert [float(opt.state[p]["step"]) for p in params] == [1.0] * 3
    assert not (tmp_path / "ckpt").exists()
    del opt.state[params[1]]
    _step(opt, params, 1)
    assert [float(opt.state[p]["step"]) for p in params] == [2.0, 1.0, 2.0]
    opt.close()


def test_a_moment_of_another_size_is_refused_by_state_dict_and_save_as_by_step(tmp_path):
    """step() refused it already; state_dict() failed on a bare reshape error and save() wrote a checkpoint whose
    checksums load() refused."""
    params = _params(torch.float32)
    opt = so.OffloadAdamW(params, lr=1e-2, offload="cpu")
    _step(opt, params, 0)
    opt.state[params[1]]["exp_avg"] = torch.zeros(301)
    for call in (lambda: _step(opt, params, 1), opt.state_dict, lambda: opt.save(tmp_path / "ckpt")):
        with pytest.raises(ValueError, match=r"parameter 1 .*no longer fits its state, which holds exp_avg"):
            call()
    assert not (tmp_path / "ckpt").exists()
    opt.close()


@pytest.mark.parametrize("value", [torch.tensor(3.0), 3.0], ids=["tensor", "number"])
def test_a_key_of_the_users_own_in_the_entry_is_refused_naming_it(value, tmp_path):
    """torch keeps a key of the user's own in optimizer.state[p] (`opt.state[p]["note"] = ...`); this optimizer's
    state_dict() and save() carry only its own fields. A tensor there was refused as a parameter that "no longer
    fits its state" (its `.data` replaced), by state_dict() and save() too, and a number was left out of them
    silently. Both are refused naming the key, before anything is stepped or saved, as nvme mode refuses them."""
    params, ref, opt, theirs = _with_torch(torch.float32)
    _step_both(opt, theirs, params, ref, 0)
    opt.state[params[1]]["note"] = value
    before = [p.detach().clone() for p in params]
    for call in (lambda: _step(opt, params, 1), opt.state_dict, lambda: opt.save(tmp_path / "ckpt")):
        with pytest.raises(RuntimeError, match=r"parameter 1 .*'note'.*not a field"):
            call()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert not (tmp_path / "ckpt").exists()
    del opt.state[params[1]]["note"]
    _step_both(opt, theirs, params, ref, 1)
    for p, q in zip(params, ref):
        assert rel_diff(p, q) <= 1e-6
    opt.close()
