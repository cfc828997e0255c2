"""Ctrl-C while the nvme pipeline cleans up after an error: it waits for the reads still in flight before their
slots can be reused, and a Ctrl-C there used to be ignored with them, so the error went on and the user's Ctrl-C
was lost. It reaches the user (after the cleanup), and the optimizer is as usable as after the error alone."""
import errno
import os

import pytest
import torch

import swapio
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import make_opt, make_params, set_grads, snapshot, train


class Scripted:
    """A read's future that waits for the real read, then raises `error` once."""

    def __init__(self, future, error):
        self.future, self.error = future, error

    def wait(self, timeout=None):
        value = self.future.wait(timeout)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return value

    result = wait

    def done(self):
        return self.future.done()

    def exception(self, timeout=None):
        try:
            self.wait(timeout)
        except Exception as exc:  # noqa: BLE001
            return exc
        return None


def test_ctrl_c_while_nvme_state_dict_cleans_up_after_a_failed_read_reaches_the_user(tmp_path, monkeypatch):
    params = make_params()
    opt = make_opt("adam", params, "nvme", tmp_path, "fp32")
    train(opt, params, 1, 2)
    want = snapshot(opt, params)
    swap = opt.swap_path
    real, reads = swapio.AioHandle.pread, []

    def pread(self, tensor, path, offset=0, **kw):
        future = real(self, tensor, path, offset, **kw)
        if os.path.dirname(os.fspath(path)) == swap:
            reads.append(future)
            if len(reads) == 1:  # the first record's read fails; the cleanup's wait for the next one gets Ctrl-C
                return Scripted(future, OSError(errno.EIO, "Input/output error", os.fspath(path)))
            if len(reads) == 2:
                return Scripted(future, KeyboardInterrupt())
        return future

    monkeypatch.setattr(swapio.AioHandle, "pread", pread)
    with pytest.raises(KeyboardInterrupt):
        opt.state_dict()
    monkeypatch.undo()
    assert len(reads) >= 2 and all(f.done() for f in reads)
    now = snapshot(opt, params)  # the state as it was, and the optimizer goes on
    for i in range(len(params)):
        assert torch.equal(now["params"][i], want["params"][i])
        for name, t in now["state"][i].items():
            assert torch.equal(t, want["state"][i][name]), (i, name)
    set_grads(params, 3)
    opt.step()
    opt.close()


def test_waiting_for_everything_raises_a_ctrl_c_met_after_an_error():
    """finish_all waits for every future before it raises the first error; a Ctrl-C met after an I/O error
    (the user's, while the rest were waited for) was dropped for that error."""
    from swapio.optim.finish import finish_all

    ran = []

    def failed():
        ran.append("failed")
        raise OSError(errno.EIO, "Input/output error")

    def interrupted():
        ran.append("interrupted")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        finish_all([failed, interrupted, lambda: ran.append("last")])
    assert ran == ["failed", "interrupted", "last"]  # everything still waited for first
    assert isinstance(info.value.__context__, OSError)  # the error is not lost either
    with pytest.raises(OSError):
        finish_all([failed, failed])  # errors alone: the first


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_close_removes_the_swap_directory_is_raised_once_it_is_gone(tmp_path, monkeypatch):
    """A Ctrl-C landing while close() removes the nvme swap directory (found by fuzzing) left the directory half
    removed and its lock file's descriptor open for the rest of the process (close() again did nothing). It is
    raised once the directory is gone and the lock let go."""
    import shutil
    import signal

    params = make_params()
    opt = make_opt("adam", params, "nvme", tmp_path, "fp32")
    train(opt, params, 1, 2)
    swap = opt.swap_path
    real, calls = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        opt.close()
    monkeypatch.undo()
    assert calls and not os.path.exists(swap) and os.listdir(tmp_path) == []
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [t for t in held if t.startswith(str(tmp_path))]
    opt.close()  # idempotent
    again = make_opt("adam", params, "nvme", tmp_path, "fp32")  # the swap_dir is free for another optimizer
    train(again, params, 3, 3)
    again.close()


@pytest.mark.usefixtures("ctrl_c_raises")
def test_a_ctrl_c_deferred_by_a_step_is_raised_in_preference_to_an_error_ending_it():
    """DeferredSigint (a step, a one-time clean-up) records a Ctrl-C until its next consistent point; an error
    ending the block before that point dropped the recorded Ctrl-C, so the user's Ctrl-C was lost for it. It is
    raised, with the error as its context, as finish_all does; a Ctrl-C raised in the block stays alone."""
    import signal
    from swapio.core._signals import DeferredSigint

    with pytest.raises(KeyboardInterrupt) as info:
        with DeferredSigint():
            signal.raise_signal(signal.SIGINT)
            raise OSError(errno.EIO, "Input/output error")
    assert isinstance(info.value.__context__, OSError)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(SystemExit):
        with DeferredSigint():
            signal.raise_signal(signal.SIGINT)
            raise SystemExit(3)  # not an error: it goes on as it is
    with DeferredSigint() as ctrl_c:
        signal.raise_signal(signal.SIGINT)
        assert ctrl_c.pending
        ctrl_c.pending = False  # (handled: nothing left to raise)
