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


# ---- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["disk", "cpu"])
@pytest.mark.parametrize("which", ["torch", "none"])
def test_torch_optimizer_or_none_is_a_clear_error_at_backward(tmp_path, storage, which):
    model = offload(make_model(), storage, tmp_path)
    if which == "torch":
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    with one_thread():
        loss = loss_of(model, batches(MLP, 1)[0])
        with pytest.raises(ValueError, match=r"'c\.(weight|bias)'.*OffloadAdamW"):
            loss.backward()
    remove_offload(model)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_in_backward_two_backward_passes_before_step(tmp_path, storage):
    """Accumulating with in_backward=True: the RuntimeError that says so (repeated: the in-backward worker may
    still be running when the second forward starts, which must not change the error)."""
    for i in range(5):
        model = offload(make_model(), storage, tmp_path / str(i))
        data = batches(MLP, 2)
        with build_opt("AdamW", model.parameters(), tmp_path / str(i), in_backward=True) as opt, one_thread():
            loss_of(model, data[0]).backward()
            with pytest.raises(RuntimeError, match="in_backward"):
                loss_of(model, data[1]).backward()
        remove_offload(model)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_in_backward_forward_between_backward_and_step(tmp_path, storage):
    """A no_grad forward (a metric, a log) between backward and step() with in_backward=True: it must neither
    raise nor make the update running on the worker fail; training goes on exactly like resident."""
    data = batches(MLP, 3)
    want_losses, want = resident_run(MLP, torch.float32, "AdamW", data, tmp_path, 1, {})
    for i in range(4):
        model = offload(make_model(), storage, tmp_path / str(i))
        with build_opt("AdamW", model.parameters(), tmp_path / str(i), in_backward=True) as opt, one_thread():
            losses = []
            for b in data:
                loss = loss_of(model, b)
                loss.backward()
                with torch.no_grad():
                    loss_of(model, b)
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        assert_same_losses(losses, want_losses)
        remove_offload(model)
        assert_same_weights(weights(model), want)


def test_checkpoint_only_offload_cannot_be_trained(tmp_path):
    ckpt = save_checkpoint_file(make_model(), tmp_path / "m.safetensors")
    before = digest(ckpt)
    model = disk_offload(meta_model(), checkpoint=ckpt)
    with pytest.raises(ValueError, match="offload_dir"):
        build_opt("AdamW", model.parameters(), tmp_path)
    assert digest(ckpt) == before
    # nothing was claimed by the failed optimizer: a frozen forward still works, and a later good setup too
    remove_offload(model)


def test_two_optimizers_cannot_own_one_weight(tmp_path):
    model = offload(make_model(), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path):
        with pytest.raises(ValueError, match="already trained"):
            build_opt("Lion", model.parameters(), tmp_path)
    with build_opt("Lion", model.parameters(), tmp_path) as opt:  # the first closed: free again
        train(model, opt, batches(MLP, 1))
    remove_offload(model)


@pytest.mark.parametrize("in_backward", [False, True])
def test_checkpoint_bytes_unchanged_and_trained_weights_in_offload_dir(tmp_path, in_backward):
    ckpt = save_checkpoint_file(make_model(), tmp_path / "model.safetensors")
    before = digest(ckpt)
    data = batches(MLP, 3)
    want_losses, want = resident_run(MLP, torch.float32, "AdamW", data, tmp_path, 1, {})
    model = disk_offload(meta_model(), checkpoint=ckpt, offload_dir=tmp_path / "od")
    with build_opt("AdamW", model.parameters(), tmp_path, offload="nvme", in_backward=in_backward) as opt:
        assert_same_losses(train(model, opt, data), want_losses)
    assert digest(ckpt) == before
    remove_offload(model)
    assert_same_weights(weights(model), want)
    assert digest(ckpt) == before
    # offloading again from the checkpoint and the same offload_dir reads the trained weights
    again = disk_offload(meta_model(), checkpoint=ckpt, offload_dir=tmp_path / "od")
    remove_offload(again)
    assert_same_weights(weights(again), want)


def test_remove_offload_between_backward_and_step(tmp_path):
    """remove_offload of a model being trained: the weights as the latest step left them."""
    data = batches(MLP, 3)
    _, want = resident_run(MLP, torch.float32, "AdamW", data[:2], tmp_path, 1, {"offload": "nvme"})
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path, offload="nvme")
    train(model, opt, data[:2])
    with one_thread():
        loss_of(model, data[2]).backward()  # a gradient in flight, no step
    remove_offload(model)
    assert_same_weights(weights(model), want)
    opt.close()


@pytest.mark.parametrize("in_backward", [False, True])
def test_step_counts_like_torch(tmp_path, in_backward):
    model = offload(make_model(), "disk", tmp_path)
    sched_lrs = []
    with build_opt("AdamW", model.parameters(), tmp_path, in_backward=in_backward) as opt:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with one_thread():
            for b in batches(MLP, 3):
                loss_of(model, b).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                sched_lrs.append(opt.param_groups[0]["lr"])
        assert all(int(s["step"].item()) == 3 for s in opt.state.values())
    assert sched_lrs == [5e-3, 2.5e-3, 1.25e-3]
    remove_offload(model)


def test_in_backward_with_lr_scheduler_equals_resident(tmp_path):
    """The lr a scheduler sets after step k is the one step k+1 uses, also when updates run during backward."""
    data = batches(MLP, 3)

    def loop(model, opt):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
        return train_with(model, opt, data, sched)

    ref = make_model()
    with build_opt("AdamW", ref.parameters(), tmp_path / "r") as opt:
        want_losses = loop(ref, opt)
    model = offload(make_model(), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path, in_backward=True) as opt:
        assert_same_losses(loop(model, opt), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def train_with(model, opt, data, sched):
    losses = []
    with one_thread():
        for b in data:
            loss = loss_of(model, b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.detach())
    return losses


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


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_checkpoint_load_into_the_live_state_dict_of_offloaded_weights_is_refused(tmp_path, storage):
    """In cpu mode with fp32 state, opt.state_dict() holds the live state tensors, also the fp32 master of each
    offloaded weight. swapio.checkpoint.load(path, out={"optimizer": opt.state_dict()}) wrote the saved masters
    into them but left the weights the model computes with as they were: the next forward used the newer
    weights, the next step the older masters, neither torch's result (a resident model keeps its weights) nor
    load_state_dict()'s (which rewrites the offloaded weights). Now a ValueError naming load_state_dict(),
    before anything is written; loading as it says continues exactly as the run that never went past the save."""
    import swapio.checkpoint as ckpt
    data = batches(MLP, 5)
    want_losses, want_weights = resident_run(MLP, torch.float32, "AdamW", data, tmp_path / "ref",
                                             opt_kw=dict(offload="cpu"))
    model = offload(make_model(), storage, tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path, offload="cpu")
    losses = train(model, opt, data[:2])
    path = str(tmp_path / "state.safetensors")
    ckpt.save({"optimizer": opt.state_dict(), "step": 2}, path)
    train(model, opt, data[2:3])  # past the checkpoint
    before = {n: opt.param_value(p).clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"(?s)master.*load_state_dict\(\)"):
        ckpt.load(path, out={"optimizer": opt.state_dict(), "step": 0})
    assert all(torch.equal(opt.param_value(p), before[n]) for n, p in model.named_parameters())
    opt.load_state_dict(ckpt.load(path)["optimizer"])
    losses += train(model, opt, data[2:])
    assert_same_losses(losses, want_losses)
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), want_weights)


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
