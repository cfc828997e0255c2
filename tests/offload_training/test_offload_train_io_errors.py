"""I/O errors while an nvme optimizer steps offloaded weights: each parameter is fully stepped (its count, state
and weight advanced together) or untouched, and a parameter left in between is refused (step, state_dict, save)
until a checkpoint is loaded; then training goes on exactly like a run without the fault."""
import errno
import os

import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, assert_goes_on, batches, build_opt, fail_nth_write, loss_of, make_model,
                                      offload, one_thread, reference, started, train)

pytest.importorskip("safetensors")
HALF = r"half-stepped"


def snapshot(model, opt):
    return ({n: int(opt.state[p]["step"]) for n, p in model.named_parameters()},
            {n: opt.param_value(p).clone() for n, p in model.named_parameters()})


def assert_refused(opt, tmp):
    for use in (opt.step, opt.state_dict, lambda: opt.save(os.path.join(tmp, "again"))):
        with pytest.raises(RuntimeError, match=HALF):
            use()


def assert_whole_or_untouched(model, opt, before, after_step):
    """Every parameter has either its old count and value or the new ones of a fault-free step."""
    counts, values = snapshot(model, opt)
    for n in counts:
        if counts[n] == before[0][n] + 1:
            assert torch.equal(values[n], after_step[n]), n
        else:
            assert counts[n] == before[0][n] and torch.equal(values[n], before[1][n]), n
    return counts


@pytest.mark.parametrize("first,count", [(1, None), (2, 1)])
def test_state_write_failing_in_step_counts_no_step(tmp_path, monkeypatch, first, count):
    """The disk fills between backward() and step(): step() raised ENOSPC but every count had advanced, the
    weights were rewritten and most moments lost, and state_dict(), save() and later steps went on with them.
    first/count: every state write fails, or only the second (one record's)."""
    data = batches(MLP, 4)
    want = reference(str(tmp_path / "ref"), data, offload="nvme")
    three = reference(str(tmp_path / "ref3"), data[:3], offload="nvme")[1]  # the values after a clean 3rd step
    model, opt = started(str(tmp_path / "run"), data, offload="nvme")
    before = snapshot(model, opt)
    with one_thread():
        loss_of(model, data[2]).backward()
        restore = fail_nth_write(monkeypatch, "state.swap", first, "future", count)
        with pytest.raises(OSError) as info:
            opt.step()
        restore()
    assert info.value.errno == errno.ENOSPC
    counts = assert_whole_or_untouched(model, opt, before, three)
    if count is None:
        assert counts == before[0]
    else:
        assert counts != before[0]  # the records written are stepped
    assert_refused(opt, str(tmp_path))
    assert_goes_on(model, opt, str(tmp_path / "run"), data, want)
    opt.close()
    remove_offload(model)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_state_write_failing_in_backward_counts_no_step(tmp_path, monkeypatch, storage):
    """The same with in_backward=True: the worker's updates in backward fail; no count advances, and what an
    update left half done is refused until load()."""
    data = batches(MLP, 4)
    kw = dict(offload="nvme", in_backward=True)
    want = reference(str(tmp_path / "ref"), data, storage, **kw)
    model, opt = started(str(tmp_path / "run"), data, storage, **kw)
    before = snapshot(model, opt)
    with one_thread():
        restore = fail_nth_write(monkeypatch, "state.swap", 1, "future", None)
        with pytest.raises(OSError) as info:
            loss_of(model, data[2]).backward()
            opt.step()
        restore()
    assert info.value.errno == errno.ENOSPC
    counts, values = snapshot(model, opt)
    assert counts == before[0]
    if storage == "disk":  # cpu_offload's host copy is written in place: a torn weight may show its new value
        assert all(torch.equal(values[n], before[1][n]) for n in values)
    assert_refused(opt, str(tmp_path))
    assert_goes_on(model, opt, str(tmp_path / "run"), data, want)
    opt.close()
    remove_offload(model)


def fill(path):
    """Fills the file system holding `path` to the last block."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 512):
            block = b"\0" * size
            try:
                while True:
                    os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        os.fsync(fd)
    finally:
        os.close(fd)


def test_full_disk_at_the_first_step(tmp_path, small_ext4_dir):
    """A real full file system: the swap file's records are allocated at their first write, which fails with
    ENOSPC when the disk filled after backward(); the optimizer then refuses to go on until load()."""
    data = batches(MLP, 3)
    want = reference(str(tmp_path / "ref"), data, offload="nvme")
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), small_ext4_dir, offload="nvme", swap_dir=str(small_ext4_dir))
    opt.save(str(tmp_path / "saved"))  # before any step: no state
    filler = small_ext4_dir / "filler"
    with one_thread():
        loss_of(model, data[0]).backward()
        fill(filler)
        with pytest.raises(OSError) as info:
            opt.step()
    assert info.value.errno == errno.ENOSPC
    assert all(not opt.state.get(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match=HALF):
        opt.step()
    os.unlink(filler)
    opt.zero_grad()
    opt.load(str(tmp_path / "saved"))
    losses = train(model, opt, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, want[0]))
    for n, p in model.named_parameters():
        assert torch.equal(opt.param_value(p), want[1][n]), n
    opt.close()
    remove_offload(model)


@pytest.mark.parametrize("nth", [1, 3])
def test_gradient_sum_write_failing_in_backward_is_never_stepped_over(tmp_path, monkeypatch, nth):
    """offload="nvme" sums gradients in grads.swap. A write of a sum that failed in backward raised OSError, but
    the optimizer kept the sum as written: step() then stepped the weights with bytes that were never the
    gradient. Now step() and clip_grad_norm_ raise until zero_grad(); then training goes on exactly."""
    data = batches(MLP, 3)
    want = reference(str(tmp_path / "ref"), data, offload="nvme")
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "s", offload="nvme")
    before = {n: opt.param_value(p).clone() for n, p in model.named_parameters()}
    with one_thread():
        restore = fail_nth_write(monkeypatch, "grads.swap", nth, "future")
        with pytest.raises(OSError) as info:
            loss_of(model, data[0]).backward()
            opt.step()
        restore()
        assert info.value.errno == errno.ENOSPC
        for use in (opt.step, lambda: opt.clip_grad_norm_(1.0)):
            with pytest.raises(RuntimeError, match="zero_grad"):
                use()
        assert all(torch.equal(opt.param_value(p), before[n]) for n, p in model.named_parameters())
        opt.zero_grad()
        losses = train(model, opt, data)
    assert all(torch.equal(a, b) for a, b in zip(losses, want[0]))
    for n, p in model.named_parameters():
        assert torch.equal(opt.param_value(p), want[1][n]), n
    opt.close()
    remove_offload(model)
