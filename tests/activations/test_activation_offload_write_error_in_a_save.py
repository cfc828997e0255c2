"""An earlier write's error seen by the poll at the end of a later save (the write finished, failed, between the
save's two looks at it). The save raised with its new entry counted in use and no saved tensor to drop it: in a
`with` whose forward error the loop catches and goes on, that forward's session never ended, and its swap file
stayed until close()."""
import gc

import torch

from helpers.activations import swap_files
from swapio.offload import offload_activations

N = 256  # 256 KiB a saved storage


class FailsWhenSeenTwice:
    """A write future that looks unfinished to the first two polls, then finished and failed (ENOSPC)."""

    def __init__(self, inner):
        self.inner, self.looks = inner, 0

    def done(self):
        self.looks += 1
        return self.looks > 2 and self.inner.done()  # (the first save's poll, the second's first poll)

    def wait(self, timeout=None):
        self.inner.wait(timeout)
        raise OSError(28, "No space left on device")

    def exception(self, timeout=None):
        self.inner.wait(timeout)
        return OSError(28, "No space left on device")


def test_a_write_error_seen_at_the_end_of_a_save_leaves_no_session_behind(tmp_path, monkeypatch):
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=64 << 20)
    real, writes = act._res.handle.pwrite, []

    def first_fails(*args, **kwargs):
        write = real(*args, **kwargs)
        writes.append(write)
        return FailsWhenSeenTwice(write) if len(writes) == 1 else write
    monkeypatch.setattr(act._res.handle, "pwrite", first_fails)
    x = torch.randn(N, N, requires_grad=True)
    with act:  # a `with` around the loop, which catches the forward's error and goes on
        h = x * 2
        y = h.sin()  # the first write (h's)
        writes[0].wait()
        try:
            y.exp()  # the second save sees the first write fail
            raised = None
        except OSError as exc:
            raised = exc.errno
        del h, y
        monkeypatch.setattr(act._res.handle, "pwrite", real)
        loss = (x * 3).sin().sum()  # the next step
        loss.backward()
        del loss
    assert raised == 28
    assert torch.equal(x.grad, 3 * (x.detach() * 3).cos())
    gc.collect()
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()
