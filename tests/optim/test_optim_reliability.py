"""OffloadAdamW checkpoints under faults: an interrupted save never loses the committed checkpoint, a failed
load leaves the live state exactly as it was, checksums catch a flipped bit."""
import errno
import os
import shutil

import pytest
import torch

import swapio
import swapio.optim as so
from swapio.core import _durable
from swapio.optim import checkpoint
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

MODES = ["cpu", "nvme"]
SHAPES = [(3000,), (17, 33), (12001,)]


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in SHAPES]


def _opt(params, mode, tmp_path):
    extra = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    return so.OffloadAdamW(params, lr=1e-2, offload=mode, **extra)


def _steps(opt, params, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        assert st.keys() == b["state"][k].keys()
        for name, t in st.items():
            assert torch.equal(t, b["state"][k][name]), (k, name)


def _clone_sd(opt):
    sd = opt.state_dict()
    return {"param_groups": [dict(g) for g in sd["param_groups"]],
            "state": {k: {n: t.clone() for n, t in st.items()} for k, st in sd["state"].items()}}


@pytest.mark.parametrize("mode", MODES)
def test_interrupt_after_the_commit_keeps_the_new_checkpoint(mode, tmp_path, monkeypatch):
    params = _params()
    opt = _opt(params, mode, tmp_path)
    ckpt = tmp_path / "ckpt"
    _steps(opt, params, 1)
    opt.save(ckpt)
    _steps(opt, params, 1, seed=2)
    expected = _clone_sd(opt)
    real_fsync = _durable.fsync_path

    def fsync(path, directory=False):
        if directory and os.path.exists(os.path.join(path, checkpoint.FILE)) and \
                checkpoint.read_meta(path)["state"][0]["step"] == 2:
            raise KeyboardInterrupt  # Ctrl-C right after the checkpoint was renamed into place
        real_fsync(path, directory)

    monkeypatch.setattr(_durable, "fsync_path", fsync)
    with pytest.raises(KeyboardInterrupt):
        opt.save(ckpt)
    monkeypatch.undo()
    other = _opt([p.detach().clone().requires_grad_(True) for p in params], mode, tmp_path)
    other.load(ckpt)  # the committed checkpoint is whole
    _same_state(other.state_dict(), expected)
    opt.close()
    other.close()


def _failing_pread(monkeypatch, fail_at):
    """AioHandle.pread fails its fail_at-th call (0-based) with EIO, as a bad sector would."""
    real = swapio.AioHandle.pread
    calls = {"n": 0}

    def pread(self, tensor, path, offset=0, **kw):
        calls["n"] += 1
        if calls["n"] - 1 == fail_at and os.path.basename(os.fspath(path)) == checkpoint.FILE:
            raise OSError(errno.EIO, "injected read error", os.fspath(path))
        return real(self, tensor, path, offset, **kw)

    monkeypatch.setattr(swapio.AioHandle, "pread", pread)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fault", ["read_error", "flipped_bit"])
def test_failed_load_leaves_the_live_state_as_it_was(mode, fault, tmp_path, monkeypatch):
    params = _params()
    ckpt = tmp_path / "ckpt"
    donor = _opt([p.detach().clone().requires_grad_(True) for p in params], "cpu", tmp_path)
    _steps(donor, donor.param_groups[0]["params"], 1, seed=5)
    donor.save(ckpt)
    opt = _opt(params, mode, tmp_path)
    _steps(opt, params, 3)
    before = _clone_sd(opt)
    ref_params = [p.detach().clone().requires_grad_(True) for p in params]
    ref = _opt(ref_params, "cpu", tmp_path)
    ref.load_state_dict(before)
    if fault == "read_error":
        _failing_pread(monkeypatch, fail_at=1)
        with pytest.raises(OSError, match="injected"):
            opt.load(ckpt)
        monkeypatch.undo()
    else:
        meta = checkpoint.read_meta(ckpt)
        data = ckpt / meta["data"]
        with open(data, "r+b") as f:
            f.seek(meta["state"][2]["fields"]["exp_avg_sq"] + 4 * 7000 + 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(ValueError, match="checksum"):
            opt.load(ckpt)
    _same_state(opt.state_dict(), before)
    _steps(opt, params, 2, seed=9)  # and training goes on exactly as if load had not been tried
    _steps(ref, ref_params, 2, seed=9)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    opt.close()
    ref.close()
    donor.close()


def _symlink_to(victim, path):
    os.unlink(path)
    os.symlink(victim, path)


def _copy_moved_over(victim, path):
    other = str(path) + ".other"
    shutil.copyfile(victim, other)
    os.replace(other, path)


@pytest.mark.parametrize("replace, err", [(_symlink_to, errno.ELOOP), (_copy_moved_over, errno.ESTALE)])
def test_nvme_state_file_replaced_is_refused(tmp_path, replace, err):
    """The state file is read and written by path at every step: a symlink planted there later, or another
    file moved over it, is an OSError at that step, and no other file is read or written."""
    params = _params()
    (tmp_path / "swap").mkdir()
    opt = _opt(params, "nvme", tmp_path / "swap")
    _steps(opt, params, 1)
    (state_file,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "swap") for f in files
                     if not f.startswith(".")]
    victim = tmp_path / "victim.bin"
    victim.write_bytes(open(state_file, "rb").read())
    before = victim.read_bytes()
    replace(victim, state_file)
    with pytest.raises(OSError) as info:
        _steps(opt, params, 1)
    assert info.value.errno == err
    assert victim.read_bytes() == before
