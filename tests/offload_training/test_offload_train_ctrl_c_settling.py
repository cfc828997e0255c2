"""Ctrl-C landing just as the write of trained weights is collected (the signal arrives right after the native
result came back): the user's KeyboardInterrupt reaches them, and the next forward and steps work with the
weights that were written, exactly as a run without the interrupt. It used to be kept as the write's failure:
the next forward raised OSError("the last write of the trained weights ... failed (...)") for good, or the
interrupt came back later, from a step that had nothing to do with it."""
import os

import pytest

from swapio.core.handle import AioHandle
from swapio.offload import remove_offload
from helpers.ctrl_c import InterruptedAt, ctrl_c_on_call
from helpers.offload_training import MLP, batches, build_opt, make_model, offload, reference, train

pytest.importorskip("safetensors")


def interrupt_collecting_write(monkeypatch, where, n):
    """The n-th pwrite to a path containing `where` gets a Ctrl-C as its completion is first collected."""
    orig, calls = AioHandle.pwrite, [0]

    def pwrite(self, t, path, offset=0, **kw):
        future = orig(self, t, path, offset, **kw)
        if where in os.fspath(path):
            calls[0] += 1
            if calls[0] == n:
                future._request = InterruptedAt(future._request)
        return future

    monkeypatch.setattr(AioHandle, "pwrite", pwrite)
    return calls


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("in_backward", [False, True])
def test_ctrl_c_collecting_a_weight_write_reaches_the_user_and_training_goes_on(tmp_path, monkeypatch, n,
                                                                                in_backward):
    data = batches(MLP, 5)
    want = reference(str(tmp_path / "ref"), data, in_backward=in_backward)
    model = offload(make_model(), "disk", str(tmp_path / "run"))
    opt = build_opt("AdamW", model.parameters(), str(tmp_path / "s"), in_backward=in_backward)
    train(model, opt, data[:1])
    opt.save(str(tmp_path / "saved"))
    calls = interrupt_collecting_write(monkeypatch, "swapio-weights", n)
    with pytest.raises(KeyboardInterrupt):
        train(model, opt, data[1:])
    assert calls[0] >= n
    monkeypatch.undo()
    opt.zero_grad()  # (what the interrupted backward summed)
    if in_backward:  # an interrupted backward keeps the updates it made (docs/offload.md): back to the checkpoint
        opt.load(str(tmp_path / "saved"))
    done = {int(opt.state[p]["step"]) for p in model.parameters()}
    assert len(done) == 1  # a step is whole or not done
    train(model, opt, data[done.pop():])
    for name, p in model.named_parameters():
        assert opt.param_value(p).equal(want[1][name]), name
    opt.close()
    remove_offload(model)


def test_ctrl_c_while_close_waits_for_the_in_backward_worker_is_raised_after_the_cleanup(tmp_path, monkeypatch):
    """close() waits for the in_backward worker's updates: a Ctrl-C during that wait was swallowed (close went on
    and returned as if nothing had happened). It reaches the user once the optimizer is closed: the worker's
    thread ended, the swap directory gone, the weights free for another optimizer."""
    from swapio.optim.worker import UpdateWorker

    data = batches(MLP, 2)
    model = offload(make_model(), "disk", str(tmp_path / "run"))
    opt = build_opt("AdamW", model.parameters(), str(tmp_path / "s"), offload="nvme", in_backward=True)
    train(model, opt, data[:1])
    swap, worker = opt.swap_path, opt._offloaded.worker
    assert os.path.isdir(swap) and worker.executor is not None
    ctrl_c_on_call(monkeypatch, UpdateWorker, "idle", 0, how="raise")
    with pytest.raises(KeyboardInterrupt) as interrupted:
        opt.close()
    # (checked while the exception, and so close()'s frame, lives: its clean-up is done, not left to a finalizer)
    assert worker.executor is None and not os.path.exists(swap)
    del interrupted
    again = build_opt("AdamW", model.parameters(), str(tmp_path / "s2"), offload="nvme", in_backward=True)
    train(model, again, data[1:])  # the closed optimizer let go of the model's weights
    again.close()
    opt.close()  # idempotent
    remove_offload(model)
    assert model(data[0][0]).shape == data[0][1].shape


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("where", ["marked", "begun"])
def test_ctrl_c_as_a_step_marks_a_record_rewritten_leaves_it_readable_and_training_goes_on(tmp_path, monkeypatch, n,
                                                                                           where):
    """A Ctrl-C landing just as step() marked a record as being rewritten (found by fuzzing), or just as it had
    taken the record's buffer, before the code that gives both back on failure, left the mark for good: every
    later read of those weights (a forward, param_value) raised "a module needs the weights ... while an optimizer
    step rewrites them". The interrupted step leaves the records it had not stepped as they were, and training
    goes on exactly."""
    import signal

    from swapio.offload.fetch import Fetcher
    from swapio.offload.training import Training

    data = batches(MLP, 4)
    want = reference(str(tmp_path / "ref"), data)
    model = offload(make_model(), "disk", str(tmp_path / "run"))
    opt = build_opt("AdamW", model.parameters(), str(tmp_path / "s"))
    train(model, opt, data[:1])
    owner, name = (Fetcher, "rewriting") if where == "marked" else (Training, "begin")
    real, calls = getattr(owner, name), []

    def returning_into_ctrl_c(self, record, *args, **kwargs):
        out = real(self, record, *args, **kwargs)
        calls.append(record)
        if len(calls) == n:
            signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt as this returns
        return out

    monkeypatch.setattr(owner, name, returning_into_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train(model, opt, data[1:2])
    monkeypatch.undo()
    opt.zero_grad()
    for p in model.parameters():
        opt.param_value(p)  # readable again
    done = {int(opt.state[p]["step"]) for p in model.parameters()}
    if len(done) > 1:  # the step went as far as some records: back to a checkpoint of the step before
        pytest.fail(f"mixed step counts {done}")
    train(model, opt, data[done.pop():])
    for name, p in model.named_parameters():
        assert opt.param_value(p).equal(want[1][name]), name
    opt.close()
    remove_offload(model)
