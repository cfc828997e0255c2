"""A load of optimizer state ended by a Ctrl-C or an exception after its install.

Ctrl-C landing right after an nvme load renamed its new swap file over the live one (load() of a checkpoint,
load_state_dict()): the load had put back the old layout and file identity over the new file, the old file being
gone, so every later step, export or save failed with ESTALE ("another file replaced the file expected here"):
the optimizer's state was lost. The Ctrl-C now waits until the load is whole and is raised then: the optimizer
holds the loaded state and steps on exactly as one that loaded it undisturbed."""
import os
import signal

import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("ctrl_c_raises")  # real SIGINTs raise even under an ignoring runner

N = 5000


def _opt(tmp_path, name):
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(2)]
    opt = so.OffloadAdamW(params, lr=1e-2, offload="nvme", swap_dir=tmp_path / name, **SMALL_BUFFERS)
    return opt, params


def _train(opt, params, steps):
    for k in steps:
        for i, p in enumerate(params):
            p.grad = torch.randn(N, generator=torch.Generator().manual_seed(10 * k + i))
        opt.step()


def _copy(sd):
    return {i: {k: t.clone() for k, t in st.items()} for i, st in sd["state"].items()}


@pytest.mark.parametrize("via", ["load", "load_state_dict"])
def test_ctrl_c_right_after_the_rename_of_a_load_keeps_the_loaded_state(via, tmp_path, monkeypatch):
    opt, params = _opt(tmp_path, "swap")
    _train(opt, params, [0, 1])
    opt.save(tmp_path / "ckpt")
    saved_sd, saved_params = _copy(opt.state_dict()), [p.detach().clone() for p in params]
    _train(opt, params, [2])  # the live state moves on past the checkpoint
    with torch.no_grad():
        for p, v in zip(params, saved_params):
            p.copy_(v)  # the model's weights restored with the checkpoint, as a resume does

    real = os.replace

    def replace_then_ctrl_c(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if os.fspath(src).endswith(".load"):
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        if via == "load":
            opt.load(tmp_path / "ckpt")
        else:
            opt.load_state_dict({"state": saved_sd, "param_groups": opt.state_dict()["param_groups"]})
    monkeypatch.undo()

    now = _copy(opt.state_dict())
    assert now.keys() == saved_sd.keys()
    for i in saved_sd:
        for name, t in saved_sd[i].items():
            assert torch.equal(now[i][name], t), (i, name)
    ref, ref_params = _opt(tmp_path, "ref")
    with torch.no_grad():
        for p, v in zip(ref_params, saved_params):
            p.copy_(v)
    ref.load(tmp_path / "ckpt")
    _train(opt, params, [3, 4])
    _train(ref, ref_params, [3, 4])
    for p, q in zip(params, ref_params):
        assert torch.equal(p.detach(), q.detach())
    opt.close()
    ref.close()
    assert os.listdir(tmp_path / "swap") == []


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_a_load_post_hook_that_raises_leaves_the_loaded_state_as_torch(mode, tmp_path):
    """A user's load_state_dict post-hook runs after ours installed the state; when it raised, load_state_dict put
    the old step counts and groups back, while in nvme mode the swap file already held the loaded moments: a
    state of neither run, silently. torch keeps the loaded state when a post-hook raises; so do we, in both modes."""
    import copy
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(2)]
    extra = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    opt = so.OffloadAdamW(params, lr=1e-2, offload=mode, **extra)
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    theirs = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for o, ps in ((opt, params), (theirs, ref)):
        _train(o, ps, [0, 1])
    saved, saved_ref = copy.deepcopy(opt.state_dict()), copy.deepcopy(theirs.state_dict())
    for o, ps in ((opt, params), (theirs, ref)):
        _train(o, ps, [2])

    def failing(optimizer):
        raise RuntimeError("a user's hook failed")

    for o, sd in ((opt, saved), (theirs, saved_ref)):
        o.register_load_state_dict_post_hook(failing)
        with pytest.raises(RuntimeError, match="a user's hook failed"):
            o.load_state_dict(copy.deepcopy(sd))
    assert float(theirs.state[ref[0]]["step"]) == 2.0  # torch: the loaded state stays
    now = _copy(opt.state_dict())
    for i in saved["state"]:
        for name, t in saved["state"][i].items():
            assert torch.equal(now[i][name], t), (i, name)
    for o, ps in ((opt, params), (theirs, ref)):
        _train(o, ps, [3, 4])
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    opt.close()


def test_ctrl_c_while_a_load_writes_its_records_abandons_it_and_keeps_the_live_state(tmp_path, monkeypatch):
    """The other side: Ctrl-C while the load still writes the new swap file (a long load of a large state) stops
    it at the next record, before the rename; the optimizer keeps its live state and the new file is removed."""
    import swapio
    opt, params = _opt(tmp_path, "swap")
    _train(opt, params, [0, 1])
    opt.save(tmp_path / "ckpt")
    _train(opt, params, [2])
    live = _copy(opt.state_dict())
    real, writes = swapio.AioHandle.pwrite, []

    def pwrite(self, tensor, path, offset=0, **kwargs):
        if os.fspath(path).endswith(".load"):
            writes.append(offset)
            if len(writes) == 1:
                signal.raise_signal(signal.SIGINT)
        return real(self, tensor, path, offset, **kwargs)

    monkeypatch.setattr(swapio.AioHandle, "pwrite", pwrite)
    with pytest.raises(KeyboardInterrupt):
        opt.load(tmp_path / "ckpt")
    monkeypatch.undo()
    assert writes
    now = _copy(opt.state_dict())
    for i in live:
        for name, t in live[i].items():
            assert torch.equal(now[i][name], t), (i, name)
    assert sorted(os.listdir(opt.swap_path)) == [".swapio-owner", "state.swap"]
    opt.load(tmp_path / "ckpt")  # and loads after
    opt.close()
