"""read_into to a GPU, run on the CPU against a simulated CUDA layer: its copies run on a side stream, which a GPU
may run before the work the caller's stream still has queued. The tensors read into may be the caller's (load's
out=, a model's parameters) with kernels queued that still read them: the copies must wait for those."""
import contextlib

import pytest
import torch

import swapio
from helpers.fake_cuda import Event, Stream
from swapio.core import cuda_copy
from swapio.safetensors import open_checkpoint, read_into


def _fake_cuda(monkeypatch):
    """(compute stream, copy stream) of a simulated CUDA layer that runs queued copies only when told."""
    compute, side = Stream(), Stream()

    def copy_async(dst, src, stream, wait_for=None, hold=True):
        if wait_for is not None:
            stream.wait_event(wait_for)
        stream.enqueue(lambda dst=dst, src=src.clone(): dst.copy_(src))  # (src: a buffer refilled later)
        event = Event()
        event.record(stream)
        return event
    monkeypatch.setattr(cuda_copy, "copy_async", copy_async)
    monkeypatch.setattr(cuda_copy, "copy_stream", lambda device, direction="to_device": side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    return compute, side


def test_copies_into_the_callers_tensors_wait_for_the_work_queued_on_its_stream(monkeypatch, tmp_path):
    compute, side = _fake_cuda(monkeypatch)
    saved = torch.arange(4096, dtype=torch.float32)
    swapio.checkpoint.save({"w": saved}, tmp_path / "c.safetensors")
    weight = torch.full((4096,), -1.0)  # "on the GPU": a kernel the caller queued still reads its old values
    seen = []
    compute.enqueue(lambda: seen.append(weight.clone()))
    read_into([(open_checkpoint(tmp_path / "c.safetensors")["w"], weight)], "cuda:0")
    side.run_all()  # the GPU may run the copy stream first ...
    compute.run_all()
    assert torch.equal(seen[0], torch.full((4096,), -1.0))  # ... the kernel read the values before the load
    assert torch.equal(weight, saved)


def test_after_a_failed_read_the_callers_stream_does_not_overtake_the_copies_queued_before(monkeypatch, tmp_path):
    compute, side = _fake_cuda(monkeypatch)
    saved = torch.arange(4096, dtype=torch.float32)
    swapio.checkpoint.save({"w": saved}, tmp_path / "c.safetensors")
    real = swapio.AioHandle()

    class FailedRead:
        def wait(self, timeout=None):
            raise OSError(5, "I/O error")

    class FailingSecondRead:  # the first window is read (and its copy queued), then the disk fails
        calls = 0

        def pread(self, *args, **kwargs):
            FailingSecondRead.calls += 1
            return FailedRead() if FailingSecondRead.calls == 2 else real.pread(*args, **kwargs)
    weight = torch.full((4096,), -1.0)
    try:
        with pytest.raises(OSError, match="I/O error"):
            read_into([(open_checkpoint(tmp_path / "c.safetensors")["w"], weight)], "cuda:0",
                      handle=FailingSecondRead(), staging_bytes=2 * 4096)
    finally:
        real.close()
    compute.enqueue(lambda: weight.fill_(7.0))  # the caller sets the tensor again after the failed load
    compute.run_all()  # the GPU may run the caller's stream first ...
    side.run_all()
    assert torch.equal(weight, torch.full((4096,), 7.0))  # ... the late copy did not overwrite what it set
