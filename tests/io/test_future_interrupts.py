"""A Ctrl-C (or SystemExit) that lands while a future settles is the caller's, never the operation's outcome: it
propagates from wait()/result()/exception() at once, and the future is left so that the next call tells the truth.
The signal is simulated where it lands: a native result() that raises it (a signal right after the native call
returned, before its value was kept), or a `then` step that raises it or raises SIGINT itself."""
import signal

import pytest
import torch

from swapio.core.futures import Future
from helpers.ctrl_c import InterruptedAt, ctrl_c_on_call

INTERRUPTS = [KeyboardInterrupt, SystemExit]


class Finished:
    """A native request that has finished with `value`; its result() raises `interrupt` the first time (the
    signal landing just as the native call returned). Its result can be taken again, as a native one's."""

    def __init__(self, value=8, interrupt=None):
        self.value, self.interrupt, self.results = value, interrupt, 0

    def wait(self, timeout=None):
        return True

    def done(self):
        return True

    def result(self):
        self.results += 1
        if self.interrupt is not None:
            interrupt, self.interrupt = self.interrupt, None
            raise interrupt()
        return self.value


class Steps:
    """A `then` (value -> value + 1) whose first call raises `interrupt` halfway, and an `undo` that records."""

    def __init__(self, interrupt=None):
        self.interrupt, self.thens, self.undone = interrupt, 0, []

    def then(self, value):
        self.thens += 1
        if self.interrupt is not None:
            interrupt, self.interrupt = self.interrupt, None
            raise interrupt()
        return value + 1

    def undo(self, exc):
        self.undone.append(exc)


@pytest.mark.parametrize("interrupt", INTERRUPTS)
@pytest.mark.parametrize("ask", ["exception", "wait"])
def test_interrupt_inside_then_propagates_and_the_future_fails_saying_so(interrupt, ask):
    steps = Steps(interrupt)
    f = Future(Finished(), then=steps.then, undo=steps.undo)
    with pytest.raises(interrupt):
        getattr(f, ask)()  # the user's Ctrl-C reaches them, not stored as the operation's outcome
    # `then` may have done half its work: the future has failed, undo ran once, and every later call says why
    assert f.done() and steps.thens == 1 and len(steps.undone) == 1
    with pytest.raises(RuntimeError, match="interrupted") as info:
        f.wait()
    assert isinstance(info.value.__cause__, interrupt)
    assert f.exception() is info.value and steps.undone == [info.value]
    assert steps.thens == 1  # never run again on a half-finished step


@pytest.mark.parametrize("interrupt", INTERRUPTS)
@pytest.mark.parametrize("ask", ["exception", "wait"])
def test_interrupt_before_the_result_is_kept_propagates_and_the_next_wait_settles(interrupt, ask):
    steps = Steps()
    request = Finished(value=8, interrupt=interrupt)
    f = Future(request, then=steps.then, undo=steps.undo)
    with pytest.raises(interrupt):
        getattr(f, ask)()
    assert steps.thens == 0 and steps.undone == []  # nothing was done with the result yet
    assert f.wait() == 9  # settled from the request again: the operation itself succeeded
    assert f.exception() is None and steps.thens == 1 and request.results == 2


def test_interrupt_of_a_plain_future_leaves_it_to_settle_normally():
    request = Finished(value=5, interrupt=KeyboardInterrupt)
    f = Future(request)
    with pytest.raises(KeyboardInterrupt):
        f.exception()
    assert f.exception() is None and f.wait() == 5


def test_errors_stay_the_operations_outcome():
    def broken(value):
        raise ValueError("bad bytes")

    undone = []
    f = Future(Finished(), then=broken, undo=undone.append)
    assert isinstance(f.exception(), ValueError)
    with pytest.raises(ValueError, match="bad bytes"):
        f.wait()
    assert len(undone) == 1


@pytest.mark.parametrize("ask", ["exception", "wait"])
def test_a_real_sigint_inside_then_of_a_real_read_reaches_the_caller(handle_factory, tmp_path, ask):
    h = handle_factory()
    data = torch.arange(4096, dtype=torch.uint8)
    h.pwrite(data, tmp_path / "f.bin").wait()
    out = torch.empty_like(data)
    undone = []

    def then(n):
        signal.raise_signal(signal.SIGINT)  # Python runs the handler (KeyboardInterrupt) right here
        return n

    f = h.pread(out, tmp_path / "f.bin")._chain(then, undone.append)
    with pytest.raises(KeyboardInterrupt):
        getattr(f, ask)()
    with pytest.raises(RuntimeError, match="interrupted"):
        f.wait()
    assert len(undone) == 1
    assert torch.equal(out, data)  # the read itself finished; only its follow-up step was cut


def test_ctrl_c_while_a_handle_collects_finished_requests_reaches_the_caller(handle_factory, tmp_path):
    """pwrite collects the finished futures it tracks (once enough are pending): a Ctrl-C landing there used to be
    kept as that write's failure, and pwrite returned as if nothing had happened."""
    h = handle_factory()
    data = torch.arange(4096, dtype=torch.uint8)
    first = h.pwrite(data, tmp_path / "a.bin")
    assert first._request.wait(None)  # finished, not yet collected
    first._request = Finished(value=first._request.result(), interrupt=KeyboardInterrupt)
    h._prune_at = len(h._pending) + 1  # the next pwrite collects the finished ones
    with pytest.raises(KeyboardInterrupt):
        h.pwrite(data, tmp_path / "b.bin")
    assert h.wait() == 2 * data.numel()  # both writes counted (the second was submitted before the Ctrl-C)
    assert first.wait() == data.numel()
    assert (tmp_path / "b.bin").read_bytes() == bytes(data.tolist())


def test_ctrl_c_in_a_verified_swap_in_reaches_the_caller_and_swap_in_can_be_called_again(tmp_path, monkeypatch):
    """The checksum check of a verified swap_in runs as the read's `then`: interrupted there, the swap_in fails
    saying so (the source stays released, as after a failed read) and a second swap_in brings the bytes back."""
    import swapio
    from swapio.core import _checksum

    store = swapio.SwapStore(tmp_path / "swap", verify=True)
    t = torch.randn(1000)
    want = t.clone()
    swapped = store.swap_out(t).wait()
    assert not swapped.is_resident
    ctrl_c_on_call(monkeypatch, _checksum, "digest", 0, how="raise")
    f = swapped.swap_in()
    with pytest.raises(KeyboardInterrupt):
        f.exception()
    with pytest.raises(RuntimeError, match="interrupted"):
        f.wait()
    assert not swapped.is_resident
    assert torch.equal(swapped.swap_in().wait(), want) and swapped.is_resident
    store.close()


def test_ctrl_c_in_swapstore_remove_reaches_the_caller_after_the_file_is_removed(tmp_path, monkeypatch):
    """remove() ignores the error of a write whose caller has already seen it; a Ctrl-C landing in remove()'s wait
    for that write was ignored with it."""
    import swapio

    store = swapio.SwapStore(tmp_path / "swap")
    swapped = store.swap_out(torch.randn(100)).wait()  # its outcome seen
    path = swapped.path

    def wait(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(swapio.SwappedTensor, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        store.remove(swapped)
    assert swapped.name not in store and not (tmp_path / "swap" / path).exists()
    store.close()


def test_ctrl_c_while_a_handle_closes_is_raised_once_every_request_let_go_of_its_memory(handle_factory, tmp_path):
    """close() settles every finished request so that none keeps the caller's memory: a Ctrl-C landing there is
    raised after all of them did (it used to be kept as one write's failure, and close() returned)."""
    h = handle_factory()
    data = [torch.full((4096,), i, dtype=torch.uint8) for i in range(3)]
    futures = [h.pwrite(d, tmp_path / f"{i}.bin") for i, d in enumerate(data)]
    assert futures[0]._request.wait(None)
    futures[0]._request = Finished(value=futures[0]._request.result(), interrupt=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        h.close()
    assert h.closed
    assert all(f._keepalive is None for f in futures[1:])  # settled: the memory is the caller's again
    assert [f.wait() for f in futures] == [4096] * 3


def test_a_gpu_swap_ins_future_reports_an_interrupted_follow_up_like_any_future():
    """exception() of the read-then-copy future (swap_in to a GPU) returns the interrupted step's RuntimeError,
    as Future.exception() does, and raises the Ctrl-C itself (its read's follow-up step cut; no GPU needed: the
    copy is never issued)."""
    from swapio.core.cuda_copy import DeviceCopyFuture

    steps = Steps(KeyboardInterrupt)
    read = Future(Finished(), then=steps.then, undo=steps.undo)
    f = DeviceCopyFuture(read, issue=lambda: pytest.fail("no copy after a failed read"), target=None)
    with pytest.raises(KeyboardInterrupt):
        f.exception()
    assert isinstance(f.exception(), RuntimeError) and f.done()


def test_ctrl_c_while_a_handle_lets_go_of_a_seen_request_keeps_it_counted(handle_factory, tmp_path):
    """Seeing a chained future's outcome lets the handle forget its request (counting its bytes for h.wait());
    a Ctrl-C there used to drop it from the handle uncounted, so h.wait() returned too few bytes."""
    h = handle_factory()
    data = torch.arange(4096, dtype=torch.uint8)
    h.pwrite(data, tmp_path / "f.bin").wait()
    assert h.wait() == 4096
    out = torch.empty_like(data)
    read = h.pread(out, tmp_path / "f.bin")
    read._request = InterruptedAt(read._request, 2)  # the chained future takes the result, then the handle
    chained = read._chain(lambda n: n)
    with pytest.raises(KeyboardInterrupt):
        chained.wait()
    assert chained.wait() == 4096 and torch.equal(out, data)
    assert h.wait() == 4096  # the read is counted once, not lost
