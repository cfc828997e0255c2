"""The CUDA staging path, checked without a GPU where fakes can stand in for the CUDA runtime: device names are
normalised, empty_pinned creates no CUDA context for CPU-only work, blocks are registered lazily before their
first GPU copy, and a refused registration does not leave CUDA's last error set."""
import contextlib
import gc
import warnings

import pytest
import torch

import swapio
from swapio.core import _cudart, cuda_copy, pinned


def test_cuda_without_index_means_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_copy.normalize_device("cuda") == torch.device("cuda", 3)
    assert cuda_copy.normalize_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert cuda_copy.normalize_device("cuda:1") == torch.device("cuda", 1)
    assert cuda_copy.normalize_device(2) == torch.device("cuda", 2)
    assert cuda_copy.normalize_device("cpu") == torch.device("cpu")
    with pytest.raises(TypeError):
        cuda_copy.normalize_device(True)


def test_find_cudart_among_mapped_libraries():
    paths = ["/usr/lib/libc.so.6", "/venv/nvidia/cuda_runtime/lib/libcudart.so.12", "/x/libcudnn.so.9"]
    assert _cudart.find_cudart(paths) == "/venv/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert _cudart.find_cudart(["/torch/lib/libcudart-9335f6a2.so.12"]) == "/torch/lib/libcudart-9335f6a2.so.12"
    assert _cudart.find_cudart(["/usr/lib/libc.so.6"]) is None


class FakeCudart:
    def __init__(self, register_rc=0):
        self.calls, self.register_rc = [], register_rc

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        return self.register_rc

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


class FakeLib:
    def __init__(self):
        self.cleared = 0

    def cudaGetLastError(self):
        self.cleared += 1
        return 0


@pytest.fixture
def fake_cuda(monkeypatch, fresh_warnings):
    """CUDA 'available' with a fake runtime; `state.initialized` says whether this process has used CUDA."""
    rt, lib = FakeCudart(), FakeLib()

    class State:
        initialized = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: State.initialized)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_cudart, "_cudart", lambda: lib)
    State.queued = []  # what swapio queued to run when CUDA initialises (torch.cuda._lazy_call)
    monkeypatch.setattr(torch.cuda, "_lazy_call", State.queued.append)
    monkeypatch.setattr(pinned, "_at_cuda_init", [False])
    # a registry of this test's blocks only: the fake must not "register" the live blocks of other tests (their
    # release would then unregister them through the real runtime)
    monkeypatch.setattr(pinned, "_starts", [])
    monkeypatch.setattr(pinned, "_ends", {})
    monkeypatch.setattr(pinned, "_cuda_registered", set())
    State.rt, State.lib = rt, lib
    return State


def test_empty_pinned_does_nothing_cuda_while_cuda_is_unused(fake_cuda):
    buf = swapio.empty_pinned(1 << 20, torch.uint8)
    assert fake_cuda.rt.calls == []  # no cudaHostRegister: it would create a context on the current GPU
    assert swapio.is_pinned(buf)
    del buf
    gc.collect()
    assert fake_cuda.rt.calls == []


def test_blocks_allocated_before_cuda_are_registered_when_cuda_starts(fake_cuda):
    before = swapio.empty_pinned(1 << 20, torch.uint8)
    also_before = swapio.empty_pinned(8192, torch.uint8)
    freed = swapio.empty_pinned(4096, torch.uint8)
    del freed
    gc.collect()
    assert fake_cuda.rt.calls == [] and len(fake_cuda.queued) == 1  # queued once, nothing CUDA done yet
    fake_cuda.initialized = True
    fake_cuda.queued[0]()  # what torch runs inside its CUDA initialisation
    assert sorted(fake_cuda.rt.calls) == sorted([("register", before.data_ptr(), 1 << 20, 1),
                                                 ("register", also_before.data_ptr(), 8192, 1)])
    after = swapio.empty_pinned(4096, torch.uint8)
    assert fake_cuda.rt.calls[-1] == ("register", after.data_ptr(), 4096, 1) and len(fake_cuda.queued) == 1
    assert pinned.cuda_register(before) and len(fake_cuda.rt.calls) == 3  # already registered: once


def test_registering_at_cuda_start_never_raises(fake_cuda):
    buf = swapio.empty_pinned(4096, torch.uint8)

    def broken(*args):
        raise RuntimeError("driver gone")
    fake_cuda.rt.cudaHostRegister = broken
    fake_cuda.initialized = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fake_cuda.queued[0]()  # an exception here would fail torch's CUDA initialisation
    assert any("driver gone" in str(w.message) for w in caught)
    del buf


def test_a_forked_child_forgets_the_parents_registrations(fake_cuda):
    import os
    fake_cuda.initialized = True
    buf = swapio.empty_pinned(4096, torch.uint8)
    assert pinned._cuda_registered
    pid = os.fork()
    if pid == 0:  # the child: its copy of the block is not registered in any CUDA context of its own
        os._exit(0 if not pinned._cuda_registered else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pinned._cuda_registered  # the parent keeps its own
    del buf


def test_blocks_are_registered_once_before_their_first_gpu_copy(fake_cuda):
    buf = swapio.empty_pinned(1 << 20, torch.uint8)
    fake_cuda.initialized = True
    assert pinned.cuda_register(buf[4096:], device=0)
    assert pinned.cuda_register(buf, device=0)
    assert fake_cuda.rt.calls == [("register", buf.data_ptr(), 1 << 20, 1)]  # portable, whole block, once
    assert not pinned.cuda_register(torch.empty(10))  # not swapio memory: left alone
    ptr = buf.data_ptr()
    del buf
    gc.collect()
    assert fake_cuda.rt.calls[-1] == ("unregister", ptr)


def test_empty_pinned_registers_at_once_when_cuda_is_in_use(fake_cuda):
    fake_cuda.initialized = True
    buf = swapio.empty_pinned(4096, torch.uint8)
    assert fake_cuda.rt.calls == [("register", buf.data_ptr(), 4096, 1)]


def test_refused_registration_clears_cudas_last_error(fake_cuda):
    fake_cuda.initialized = True
    fake_cuda.rt.register_rc = 712  # cudaErrorHostMemoryAlreadyRegistered
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = swapio.empty_pinned(4096, torch.uint8)
    assert fake_cuda.lib.cleared == 1
    assert any("cudaHostRegister failed (712)" in str(w.message) for w in caught)
    del buf
    gc.collect()
    assert [c[0] for c in fake_cuda.rt.calls] == ["register"]  # a refused block is never unregistered


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_empty_pinned_creates_no_context_in_a_fresh_process():
    import subprocess
    import sys
    code = "import torch, swapio; swapio.empty_pinned(1 << 20); print(torch.cuda.is_initialized())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_allocated_before_cuda_starts_is_pinned_for_torch():
    import subprocess
    import sys
    code = ("import torch, swapio; t = swapio.empty_pinned(1 << 20); assert not torch.cuda.is_initialized(); "
            "torch.zeros(1, device='cuda'); print(t.is_pinned(), t[4096:].is_pinned())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True True"


class FakeEvent:
    """A CUDA event stand-in: complete once `finished` is set."""

    def __init__(self):
        self.finished = False
        self.synchronized = 0

    def query(self):
        return self.finished

    def synchronize(self):
        self.synchronized += 1
        self.finished = True


def test_copy_sources_stay_alive_until_their_event_completes():
    import weakref

    class Buffer:
        pass
    event, buf = FakeEvent(), Buffer()
    ref = weakref.ref(buf)
    cuda_copy.keep_until(event, buf)
    del buf
    cuda_copy.release_finished()
    assert ref() is not None  # the copy may still read it
    event.finished = True
    cuda_copy.release_finished()
    assert ref() is None


def test_device_copy_future_is_done_only_when_the_copy_completed(monkeypatch):
    class Stream:
        waited = []

        def wait_event(self, ev):
            self.waited.append(ev)
    stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)

    class Target:
        device, recorded = torch.device("cpu"), []

        def record_stream(self, s):
            self.recorded.append(s)
    event, issued = FakeEvent(), []
    read = swapio.Future.finished(10)  # the read into staging memory has finished
    f = cuda_copy.DeviceCopyFuture(read, lambda: issued.append(1) or event, Target())
    assert not f.done() and issued == [1]  # done() saw the read finished and issued the copy, once
    assert not f.done() and issued == [1]
    event.finished = True
    assert f.done()
    event.finished = False
    assert f.wait() is f._target and event.synchronized == 1  # waits for that copy's event only
    assert stream.waited == [event] and Target.recorded == [stream]  # the caller's stream waits on the copy
    with pytest.raises(TimeoutError):
        slow = cuda_copy.DeviceCopyFuture(read, lambda: FakeEvent(), Target())
        slow.wait(timeout=0.01)
