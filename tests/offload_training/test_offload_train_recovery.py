"""Training offloaded weights: faults and bad input must leave the optimizer usable (a failed weight write in
step(), an error of the in_backward worker, a failed weight rewrite in load(), a checkpoint for other dtypes).
The docstrings name the bug each test caught."""
import errno
import os

import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, assert_goes_on, batches, build_opt, fail_nth_write, make_model, offload,
                                      one_thread, reference, started, train)
from helpers.waiting import wait_until

pytest.importorskip("safetensors")


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_failed_weight_write_in_step_then_load_goes_on(tmp_path, monkeypatch, off):
    """Bug: a weight-store write whose future fails (ENOSPC) stays in Fetcher.writing after step() raised it;
    opt.load() then calls DiskStore.begin -> writing.pop(record).wait() and raises the old ENOSPC again
    (the disk has space now), after having installed the loaded state (commit ran) but before the weights are
    rewritten. Expected: step raises OSError(ENOSPC, path); load succeeds; training goes on exactly."""
    data = batches(MLP, 4)
    want = reference(str(tmp_path / "ref"), data, offload=off)
    model, opt = started(str(tmp_path / "run"), data, offload=off)
    restore = fail_nth_write(monkeypatch, "swapio-weights", 2, "future")
    with pytest.raises(OSError) as info:
        train(model, opt, data[2:3])
    restore()
    assert info.value.errno == errno.ENOSPC and "swapio-weights" in info.value.filename
    assert_goes_on(model, opt, str(tmp_path / "run"), data, want)
    opt.close()
    remove_offload(model)


def test_in_backward_worker_error_is_raised_once(tmp_path, monkeypatch):
    """Bug: with in_backward=True, an error of the worker's update (here the weight write raises ENOSPC) is
    raised in backward by _raise_error(), but its future stays in OffloadedParams.futures, so the next
    opt.zero_grad() (or step/save/flush/forward's settle) raises the same error a second time. Expected: the
    error reported once; zero_grad() and load() then work and training goes on exactly."""
    data = batches(MLP, 4)
    want = reference(str(tmp_path / "ref"), data, offload="cpu", in_backward=True)
    model, opt = started(str(tmp_path / "run"), data, offload="cpu", in_backward=True)
    restore = fail_nth_write(monkeypatch, "swapio-weights", 1, "raise")  # the first record updated: c
    x, y = data[2]
    with one_thread(), pytest.raises(OSError) as info:
        h = torch.tanh(model.b(model.norm(torch.tanh(model.a(x)))))
        # backward reaches b only once the worker's update of c has failed: b's gradient reports the error
        h.register_hook(lambda g: wait_until(lambda: opt._offloaded.worker.error is not None,
                                             "the failure of the worker's update of c"))
        torch.nn.functional.mse_loss(model.c(h), y).backward()
    restore()
    assert info.value.errno == errno.ENOSPC
    opt.zero_grad()  # raises the reported ENOSPC again
    assert_goes_on(model, opt, str(tmp_path / "run"), data, want)
    opt.close()
    remove_offload(model)


def test_load_whose_weight_rewrite_fails_can_be_retried(tmp_path, monkeypatch):
    """Bug: OffloadedParams.rewrite_from_master calls store.begin(record) (which marks the record REWRITING in
    the fetcher) and store.end() without try/finally: an error between them (here reading the loaded state
    fails with EIO; equally a Ctrl-C) leaves the REWRITING mark for ever. Then every forward raises "a module
    needs the weights ... while an optimizer step rewrites them", and a retried load() fails with
    AttributeError: 'object' object has no attribute 'wait' (DiskStore.begin pops the REWRITING sentinel and
    calls .wait() on it). Expected: the OSError, then a retried load() works and training goes on."""
    data = batches(MLP, 4)
    want = reference(str(tmp_path / "ref"), data, offload="cpu")
    model, opt = started(str(tmp_path / "run"), data, offload="cpu")
    train(model, opt, data[2:3])
    orig = type(opt).read_state
    calls = [0]

    def read_state(self, params, sink, *a, **k):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO), "state")
        return orig(self, params, sink, *a, **k)

    monkeypatch.setattr(type(opt), "read_state", read_state)
    with pytest.raises(OSError):
        opt.load(os.path.join(str(tmp_path / "run"), "saved"))
    assert calls[0] == 1
    assert_goes_on(model, opt, str(tmp_path / "run"), data, want)
    opt.close()
    remove_offload(model)


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_load_of_a_checkpoint_for_other_dtypes_is_a_value_error(tmp_path, off):
    """Bug (bad input: names, shapes, dtypes): the checkpoint records each parameter's dtype
    (checkpoint.py writes entry["dtype"]) but load() checks only the shape: the state of a bf16 model loads
    into an fp32 offloaded model and rewrites all its weights. Expected: ValueError naming the mismatch, the
    weights untouched."""
    data = batches(MLP, 2)
    model = offload(make_model(MLP, torch.bfloat16), "disk", tmp_path / "a", MLP, torch.bfloat16)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "sa", offload=off)
    train(model, opt, data)
    opt.save(tmp_path / "saved")
    opt.close()
    remove_offload(model)
    model = offload(make_model(), "disk", tmp_path / "b")
    opt = build_opt("AdamW", model.parameters(), tmp_path / "sb", offload=off)
    train(model, opt, data[:1])
    before = {n: opt.param_value(p).clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="dtype|bfloat16"):
        opt.load(tmp_path / "saved")
    for n, p in model.named_parameters():
        assert torch.equal(opt.param_value(p), before[n]), n
    opt.close()
    remove_offload(model)
