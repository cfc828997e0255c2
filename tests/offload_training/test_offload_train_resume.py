"""Errors of offloaded training, the user's checkpoint never written, and resume in a new process
(opt.save / a new process that builds the model on meta, offloads from the same offload_dir, load()s and goes on
bit-identically)."""
import hashlib
import os
import shutil

import pytest
import torch

from swapio.offload import disk_offload, remove_offload
from helpers import fork
from helpers.offload_training import (MLP, assert_same_losses, assert_same_weights, batches, build_opt, child, loss_of,
                                      make_model, meta_model, offload, one_thread, resident_run,
                                      save_checkpoint_file, train, weights)

pytest.importorskip("safetensors")


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def dir_digest(path):
    return {name: digest(os.path.join(path, name)) for name in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, name))}


def run_child(spec):
    assert fork.run_child(fork.fork_server(), child, spec) == 0


# ---- resume in a new process --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("source,dtype,off,state_dtype,in_backward", [
    ("od", "float32", "nvme", "fp32", False),
    ("od", "bfloat16", "cpu", "bf16", True),
    ("ckpt", "float32", "cpu", "fp32", False),
    ("ckpt", "bfloat16", "nvme", "int8", False),
])
def test_resume_in_a_new_process_is_bit_identical(tmp_path, source, dtype, off, state_dtype, in_backward):
    steps, extra, total = 2, 1, 5
    kw = dict(offload=off, state_dtype=state_dtype)
    data = batches(MLP, total)
    want_losses, want = resident_run(MLP, getattr(torch, dtype), "AdamW", data, tmp_path, 1, kw)
    spec = dict(dtype=dtype, total=total, offload=off, state_dtype=state_dtype, in_backward=in_backward,
                swap=str(tmp_path / "swap"), od=str(tmp_path / "od"), save=str(tmp_path / "saved"),
                steps=steps, extra=extra)
    before = None
    if source == "ckpt":
        spec["ckpt"] = save_checkpoint_file(make_model(MLP, getattr(torch, dtype)), tmp_path / "model.safetensors")
        before = digest(spec["ckpt"])
    run_child(dict(spec, phase="first"))
    # the storage went past the checkpoint (one more step); resume from the checkpoint in a fresh process
    out = str(tmp_path / "out.pt")
    run_child(dict(spec, phase="resume", start=steps, end=total, out=out, swap=str(tmp_path / "swap2")))
    got = torch.load(out)
    assert_same_losses(got["losses"], want_losses[steps:])
    assert_same_weights(got["weights"], want)
    if before is not None:
        assert digest(spec["ckpt"]) == before


def test_load_of_mismatched_parameters_changes_nothing(tmp_path):
    """A checkpoint of a model whose last layer has another shape: ValueError before anything is rewritten."""
    data = batches(MLP, 2)
    model = offload(make_model(), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path, offload="nvme") as opt:
        train(model, opt, data)
        opt.save(tmp_path / "saved")
    remove_offload(model)

    class Other(MLP):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Linear(16, 5)

    torch.manual_seed(7)
    other = disk_offload(Other(), tmp_path / "od2")
    opt = build_opt("AdamW", other.parameters(), tmp_path / "s2", offload="nvme")
    with one_thread():
        x = batches(MLP, 1)[0][0]
        other(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    files = dir_digest(tmp_path / "od2")
    state_before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    with pytest.raises(ValueError):
        opt.load(tmp_path / "saved")
    assert dir_digest(tmp_path / "od2") == files
    state_after = opt.state_dict()["state"][0]
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())
    # and the optimizer still trains
    with one_thread():
        other(x).square().mean().backward()
    opt.step()
    opt.close()
    remove_offload(other)


def test_load_with_fewer_parameters_changes_nothing(tmp_path):
    model = offload(make_model(), "disk", tmp_path)
    model.a.requires_grad_(False)
    with build_opt("AdamW", [p for p in model.parameters() if p.requires_grad], tmp_path, offload="cpu") as opt:
        train(model, opt, batches(MLP, 1))
        opt.save(tmp_path / "saved")
    remove_offload(model)
    model = offload(make_model(), "disk", tmp_path / "x")
    with build_opt("AdamW", model.parameters(), tmp_path, offload="cpu") as opt:
        train(model, opt, batches(MLP, 1))
        files = dir_digest(tmp_path / "x" / "od")
        with pytest.raises(ValueError):
            opt.load(tmp_path / "saved")
        assert dir_digest(tmp_path / "x" / "od") == files
    remove_offload(model)


def test_state_dict_of_offloaded_training_continues_resident(tmp_path):
    """opt.state_dict() of an offloaded model's optimizer, loaded into the resident model's optimizer (torch's
    format, with the fp32 master), continues exactly as the offloaded one does."""
    data = batches(MLP, 4)
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path, offload="nvme")
    train(model, opt, data[:2])
    sd = opt.state_dict()
    resident = offload(make_model(), "cpu", tmp_path)
    remove_offload(resident)  # a plain model again
    # its weights: the offloaded model's current ones
    mid = {n: opt.param_value(p) for n, p in zip([n for n, _ in model.named_parameters()], model.parameters())}
    with torch.no_grad():
        for n, p in resident.named_parameters():
            p.copy_(mid[n])
    ropt = build_opt("AdamW", resident.parameters(), tmp_path / "r")
    ropt.load_state_dict(sd)
    want_losses = train(resident, ropt, data[2:])
    assert_same_losses(train(model, opt, data[2:]), want_losses)
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(resident))


def test_an_offload_dir_trained_from_another_checkpoint_is_refused(tmp_path):
    """offload_dir holds weights trained from one checkpoint; offloading from another with it would silently serve
    the first one's (trained and frozen records alike)."""
    ckpt = save_checkpoint_file(make_model(), tmp_path / "a.safetensors")
    other = save_checkpoint_file(make_model(seed=1), tmp_path / "b.safetensors")
    od = tmp_path / "od"
    model = disk_offload(meta_model(), checkpoint=ckpt, offload_dir=od)
    with build_opt("AdamW", model.parameters(), tmp_path) as opt:
        train(model, opt, batches(MLP, 2))
    remove_offload(model)
    trained, before = weights(model), dir_digest(od)
    with pytest.raises(ValueError, match="trained from another checkpoint"):
        disk_offload(meta_model(), checkpoint=other, offload_dir=od)
    assert dir_digest(od) == before
    # the checkpoint it was trained from, also copied elsewhere, still gives the trained weights
    shutil.copy(ckpt, tmp_path / "copy.safetensors")
    for source in (ckpt, tmp_path / "copy.safetensors"):
        again = disk_offload(meta_model(), checkpoint=source, offload_dir=od)
        remove_offload(again)
        assert_same_weights(weights(again), trained)
    # the way out the error names: a fresh offload_dir starts from the other checkpoint
    fresh = disk_offload(meta_model(), checkpoint=other, offload_dir=tmp_path / "od2")
    remove_offload(fresh)
    assert_same_weights(weights(fresh), weights(make_model(seed=1)))
