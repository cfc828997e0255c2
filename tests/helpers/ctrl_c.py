"""Ctrl-C delivered at a chosen call, for the tests that interrupt an optimizer's step: the at-th call (0-based) of
a function, or the at-th read or write of the optimizer's own swap file; and a native request whose result() is
interrupted, for the tests of what a future does then."""
import os
import signal

import swapio


def ctrl_c_on_call(monkeypatch, owner, name, at, how="signal", after=False):
    """Makes the at-th call of owner.name deliver Ctrl-C: how="signal" sends SIGINT to this process (before the real
    call, or after it with after=True); how="raise" raises KeyboardInterrupt instead of it. Returns the call count."""
    real, calls = getattr(owner, name), {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        hit = calls["n"] - 1 == at
        if hit and how == "raise":
            raise KeyboardInterrupt
        if hit and not after:
            signal.raise_signal(signal.SIGINT)
        out = real(*args, **kwargs)
        if hit and after:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def ctrl_c_on_swap_io(opt, monkeypatch, name, at):
    """Ctrl-C at the at-th `name` ("pread" or "pwrite") of the optimizer's swap file."""
    real, calls = getattr(swapio.AioHandle, name), {"n": 0}

    def wrapper(self, tensor, path, offset=0, **kw):
        if os.path.dirname(os.fspath(path)) == opt.swap_path:
            calls["n"] += 1
            if calls["n"] - 1 == at:
                signal.raise_signal(signal.SIGINT)
        return real(self, tensor, path, offset, **kw)

    monkeypatch.setattr(swapio.AioHandle, name, wrapper)


class InterruptedAt:
    """A native request whose n-th result() (1-based) raises KeyboardInterrupt (Ctrl-C as the result comes back);
    the others return the request's result."""

    def __init__(self, request, n=1):
        self.request, self.n, self.results = request, n, 0

    def wait(self, timeout=None):
        return self.request.wait(timeout)

    def done(self):
        return self.request.done()

    def result(self):
        self.results += 1
        if self.results == self.n:
            raise KeyboardInterrupt
        return self.request.result()
