"""Activation offload's GPU path on the CPU: fake_cuda's streams and events, with the saved tensors that are not
in pinned memory counted as on a GPU (activation_store.on_gpu).

Copies run only when something waits for them, as a GPU may run them late. `problems` collects what a real GPU
would have made silently wrong: a copy that runs after its pinned block of the pool was handed out again, a
block handed out while a read or write of the disk still uses it (or given back with nothing for the pool to
wait for), a block handed out or given back twice. The pool's and the handle's methods are wrapped on the
instances of one ActivationOffload (watch()).
"""
import contextlib
import gc

import pytest
import torch

from helpers.fake_cuda import Event, Stream
from swapio.core import cuda_copy, pinned
from swapio.offload import activation_store, offload_activations


def _block(t):
    return t.untyped_storage().data_ptr()


class FakeGpu:
    def __init__(self, monkeypatch):
        self.trace, self.problems, self.recorded = [], [], []
        self.compute = Stream("compute", self.trace)
        self.sides = {"to_device": Stream("h2d", self.trace), "to_host": Stream("d2h", self.trace)}
        self.handed = {}   # pool block address -> how many times alloc handed it out
        self.in_use = set()  # pool blocks handed out and not given back
        self.io = {}       # pool block address -> futures of the reads and writes submitted on it
        self.side_allocations = 0

        def synchronize(*args):
            raise AssertionError("the offload waited for the whole device")

        def record_stream(tensor, stream):
            self.recorded.append((_block(tensor), stream.name))

        @contextlib.contextmanager
        def allocating_on_side_stream(device):
            self.side_allocations += 1
            yield

        monkeypatch.setattr(activation_store, "on_gpu", lambda t: not pinned.is_pinned(t))
        for module in (activation_store, cuda_copy):
            monkeypatch.setattr(module, "copy_async", self.copy_async)
            monkeypatch.setattr(module, "copy_stream", lambda device, direction="to_device": self.sides[direction])
        monkeypatch.setattr(activation_store, "allocating_on_side_stream", allocating_on_side_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.compute)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        monkeypatch.setattr(Event, "trace", self.trace)

    def run_all(self):
        """The GPU catches up: every stream runs what it has queued."""
        for stream in (self.compute, *self.sides.values()):
            stream.run_all()

    # ---- the copies -------------------------------------------------------------------------------------------
    def copy_async(self, dst, src, stream, wait_for=None, hold=True):
        assert hold, "the activation path holds what its copies read and write"
        if wait_for is not None:
            stream.wait_event(wait_for)
        what = "to host" if pinned.is_pinned(dst) else "to device"
        # the pool blocks it touches, as handed out now: a block handed out again before the copy ran is another's
        blocks = [(_block(t), self.handed.get(_block(t))) for t in (dst, src) if pinned.is_pinned(t)]
        for ptr, _ in blocks:
            if ptr in self.handed and ptr not in self.in_use:
                self.problems.append(f"a copy {what} was queued on a pool block given back to the pool")

        def run(dst=dst.detach(), src=src.detach()):
            for ptr, handed in blocks:
                if self.handed.get(ptr) != handed:
                    self.problems.append(f"a copy {what} ran after its pool block was handed out again")
            with torch.no_grad():
                dst.copy_(src)
        self.trace.append(("queued", stream.name, what))
        stream.enqueue(run, what)
        event = Event()
        event.record(stream)
        return event

    # ---- the pool and the disk of one ActivationOffload ---------------------------------------------------------
    def watch(self, act):
        res = act._res
        pool, alloc, free = res.pool, res.pool.alloc, res.pool.free

        def watched_alloc(nbytes):
            block = alloc(nbytes)
            ptr = _block(block)
            if ptr in self.in_use:
                self.problems.append("the pool handed out a block in use")
            if self._disk_uses(ptr):
                self.problems.append("the pool handed out a block the disk still reads or writes")
            self.in_use.add(ptr)
            self.handed[ptr] = self.handed.get(ptr, 0) + 1
            return block

        def watched_free(block, event=None):
            ptr = _block(block)
            if ptr not in self.in_use:
                self.problems.append("a block was given back to the pool twice")
            if event is None and self._disk_uses(ptr):  # (with an event, the pool waits for it: see alloc)
                self.problems.append("a block was given back to the pool while the disk still reads or writes it")
            self.in_use.discard(ptr)
            free(block, event)
        pool.alloc, pool.free = watched_alloc, watched_free
        if res.handle is not None:
            res.handle = _WatchedHandle(res.handle, self)
        return pool

    def _disk_uses(self, ptr):
        return any(not f.done() for f in self.io.get(ptr, ()))


class _WatchedHandle:
    """The offload's AioHandle, noting the reads and writes on pool blocks."""

    def __init__(self, inner, gpu):
        self.inner, self.gpu = inner, gpu

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pread(self, tensor, *args, **kwargs):
        return self._noted(tensor, self.inner.pread(tensor, *args, **kwargs))

    def pwrite(self, tensor, *args, **kwargs):
        return self._noted(tensor, self.inner.pwrite(tensor, *args, **kwargs))

    def _noted(self, tensor, future):
        if pinned.is_pinned(tensor):
            ptr = _block(tensor)
            if ptr not in self.gpu.in_use:
                self.gpu.problems.append("the disk was given a pool block not handed out")
            self.gpu.io[ptr] = [f for f in self.gpu.io.get(ptr, ()) if not f.done()] + [future]
        return future


@pytest.fixture
def gpu(monkeypatch):
    """The simulated GPU for one test (test modules import this fixture): at the end it runs what the GPU had left
    and fails the test on any problem it saw."""
    fake = FakeGpu(monkeypatch)
    yield fake
    fake.run_all()
    assert not fake.problems, fake.problems


def watched_offload(gpu, to, swap_dir, **kw):
    """(offload_activations(to, min_bytes=0, **kw) watched by `gpu`, its pinned pool)."""
    act = offload_activations(to, swap_dir=swap_dir if to == "nvme" else None, min_bytes=0, **kw)
    return act, gpu.watch(act)


def all_back(pool):
    """Every pinned block of the pool is back in it (none counted in use), once the garbage is collected."""
    gc.collect()
    return pool.in_use == 0
