"""Edits of optimizer.state[p] that torch's optimizers honour (a moment zeroed or replaced, a whole entry
replaced): cpu mode reads them as torch does, nvme mode (whose arrays are in the swap file) refuses them loudly
instead of stepping on with the old arrays while opt.state[p] shows the new ones."""
import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

SHAPE = (6, 7)


def _grad(k):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + k))


def _pair(mode, tmp_path, layout=lambda t: t):
    """(ours, its parameter, torch's AdamW, its parameter): the same start and hyperparameters."""
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    p, q = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    extra = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    ours = so.OffloadAdamW([p], lr=1e-2, weight_decay=0.1, offload=mode, **extra)
    theirs = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1, foreach=False)
    return ours, p, theirs, q


def _step(opt, p, k):
    p.grad = _grad(k)
    opt.step()


REPLACEMENTS = {
    "zeros": lambda: torch.zeros(SHAPE),
    "transposed": lambda: torch.full(SHAPE[::-1], 0.25).t(),  # non-contiguous, as torch accepts
    "strided": lambda: torch.full((SHAPE[0], 2 * SHAPE[1]), 0.25)[:, ::2],
}


@pytest.mark.parametrize("make", REPLACEMENTS.values(), ids=REPLACEMENTS.keys())
@pytest.mark.parametrize("field", ["exp_avg", "exp_avg_sq"])
def test_cpu_mode_steps_a_replaced_moment_as_torch(field, make, tmp_path):
    """A non-contiguous replacement raised an obscure view error from deep in the step."""
    ours, p, theirs, q = _pair("cpu", tmp_path)
    for k in range(4):
        if k == 2:
            ours.state[p][field] = make()
            theirs.state[q][field] = make()
        _step(ours, p, k)
        _step(theirs, q, k)
    close = dict(rtol=1e-6, atol=1e-7)  # (the kernel rounds a few ulps apart from torch's ops)
    torch.testing.assert_close(p.detach(), q.detach(), **close)
    sd, ref = ours.state_dict()["state"][0], theirs.state_dict()["state"][0]
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(sd[name], ref[name], **close, msg=name)
    ours.close()


@pytest.mark.parametrize("how", ["setitem", "update", "setdefault", "ior"])
def test_nvme_mode_refuses_a_moment_set_in_the_state_entry(how, tmp_path):
    """The assignment went into the entry, which the nvme backend never reads: the step went on with the swap
    file's moments (torch's with the new ones), silently."""
    ours, p, _, _ = _pair("nvme", tmp_path)
    _step(ours, p, 0)
    entry = ours.state[p]
    value = torch.zeros(SHAPE)
    with pytest.raises(RuntimeError, match=r"exp_avg.*nvme.*swap file.*load_state_dict"):
        if how == "setitem":
            entry["exp_avg"] = value
        elif how == "update":
            entry.update(exp_avg=value)
        elif how == "setdefault":
            entry.setdefault("exp_avg", value)
        else:
            entry |= {"exp_avg": value}
    assert list(entry) == ["step"]
    entry["step"] = torch.tensor(5.0)  # the count is the entry's own: setting it stays as with torch
    _step(ours, p, 1)
    assert float(ours.state[p]["step"]) == 6.0
    ours.close()


def test_nvme_mode_refuses_a_whole_entry_replaced_with_arrays(tmp_path):
    """`opt.state[p] = {...}` with moments in it: step(), state_dict() and save() refuse it (they would use, or
    export, the swap file's moments instead), naming the parameter; `del opt.state[p]` goes on as torch's reset."""
    ours, p, theirs, q = _pair("nvme", tmp_path)
    _step(ours, p, 0)
    _step(theirs, q, 0)
    before = p.detach().clone()
    ours.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(SHAPE), "exp_avg_sq": torch.zeros(SHAPE)}
    for call in (lambda: _step(ours, p, 1), ours.state_dict, lambda: ours.save(tmp_path / "ckpt")):
        with pytest.raises(RuntimeError, match=r"parameter 0.*\['exp_avg', 'exp_avg_sq'\].*nvme"):
            call()
    assert torch.equal(p.detach(), before)
    assert not (tmp_path / "ckpt").exists()
    del ours.state[p]
    del theirs.state[q]
    for k in (1, 2):
        _step(ours, p, k)
        _step(theirs, q, k)
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_a_step_count_set_as_a_number_steps_on_from_it(mode, tmp_path):
    """`opt.state[p]["step"] = 5` (older torch kept counts as ints, and loading accepts them) failed in step() and
    save() with "'int' object has no attribute 'item'". It is read as loading reads it: the run goes on as torch's
    from a count of tensor(5.)."""
    ours, p, theirs, q = _pair(mode, tmp_path)
    _step(ours, p, 0)
    _step(theirs, q, 0)
    ours.state[p]["step"] = 5
    theirs.state[q]["step"] = torch.tensor(5.0)
    ours.save(tmp_path / "ckpt")
    for k in (1, 2):
        _step(ours, p, k)
        _step(theirs, q, k)
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert torch.is_tensor(ours.state[p]["step"]) and float(ours.state[p]["step"]) == 7.0
    ours.load(tmp_path / "ckpt")
    assert float(ours.state[p]["step"]) == 5.0
    ours.close()


@pytest.mark.parametrize("bad", [-1, float("nan"), 2.5, "3"])
def test_a_step_count_set_to_a_bad_value_is_refused_naming_it(bad, tmp_path):
    ours, p, _, _ = _pair("cpu", tmp_path)
    _step(ours, p, 0)
    ours.state[p]["step"] = bad
    before = p.detach().clone()
    for call in (lambda: _step(ours, p, 1), lambda: ours.save(tmp_path / "ckpt")):
        with pytest.raises(ValueError, match=r"optimizer.state\[p\]\['step'\] of parameter 0"):
            call()
    assert torch.equal(p.detach(), before)
    ours.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_rolling_back_by_putting_back_a_copy_of_the_state_is_as_torch_or_refused(mode, tmp_path):
    """A rollback that keeps a copy of each entry (`saved = {p: copy.deepcopy(s) for p, s in opt.state.items()}`,
    later `opt.state = saved`): torch's entries hold the moments, so it goes back to them; cpu mode likewise. In
    nvme mode the entries hold only the counts, so the old counts went on with the swap file's newer moments,
    silently. That is refused now (step(), state_dict(), save()), naming both counts; a count edited in the
    entry itself is still honoured, as torch's is."""
    import copy
    ours, p, theirs, q = _pair(mode, tmp_path)
    for k in (0, 1):
        _step(ours, p, k)
        _step(theirs, q, k)
    saved = {x: copy.deepcopy(s) for x, s in ours.state.items()}
    saved_ref = {x: copy.deepcopy(s) for x, s in theirs.state.items()}
    weights = p.detach().clone()
    for k in (2, 3):
        _step(ours, p, k)
        _step(theirs, q, k)
    with torch.no_grad():
        p.copy_(weights)
        q.copy_(weights)
    ours.state = saved
    theirs.state = saved_ref
    if mode == "nvme":
        for call in (lambda: _step(ours, p, 4), ours.state_dict, lambda: ours.save(tmp_path / "ckpt")):
            with pytest.raises(RuntimeError, match=r"parameter 0.*replaced by one counting 2 steps.*step 4"):
                call()
        assert torch.equal(p.detach(), weights)
        ours.state[p]["step"] = torch.tensor(4.0)  # the entry now counts what the file holds: on as before
        _step(ours, p, 4)
        assert float(ours.state[p]["step"]) == 5.0
    else:
        _step(ours, p, 4)
        _step(theirs, q, 4)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    ours.close()


def test_nvme_mode_refuses_an_entry_for_which_the_swap_file_holds_no_state(tmp_path):
    """A parameter with no state in the swap file (never stepped, or left out of the state a load installed)
    given an entry by hand that counts steps (`opt.state[p]["step"] = t`, or an old entry put back) stepped with
    zero moments under that count, silently; torch's step refuses such an entry (KeyError 'exp_avg'). It is a
    RuntimeError now; `del opt.state[p]` starts the parameter afresh."""
    import copy
    ours, p, _, _ = _pair("nvme", tmp_path)
    other = torch.zeros(SHAPE, requires_grad=True)
    ours.add_param_group({"params": [other]})
    _step(ours, p, 0)
    ours.state[other]["step"] = torch.tensor(3.0)
    other.grad = torch.ones(SHAPE)
    with pytest.raises(RuntimeError, match=r"parameter 1.*counting 3 steps.*holds no state for it"):
        ours.step()
    del ours.state[other]
    ours.step()
    assert float(ours.state[other]["step"]) == 1.0
    # a load whose state leaves `other` out, then its old entry put back
    old_entry = ours.state[other]
    sd = copy.deepcopy(ours.state_dict())
    del sd["state"][1]
    ours.load_state_dict(sd)
    ours.state[other] = old_entry
    with pytest.raises(RuntimeError, match=r"parameter 1.*holds no state for it"):
        ours.step()
    ours.close()
