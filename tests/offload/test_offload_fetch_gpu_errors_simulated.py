"""Fetcher's GPU path run on the CPU against a simulated CUDA layer: a CUDA out-of-memory error while a module
acquires its weights (a forward at the memory limit, which callers catch and retry with a smaller batch) leaves
the fetch as it found it, not counted in use for good."""
import contextlib

import pytest
import torch

from swapio.core import cuda_copy
from swapio.offload.fetch import Fetcher
from swapio.offload.layout import Record, pack
from swapio.offload.units import Slot


class DoneEvent:
    def query(self):
        return True

    def synchronize(self):
        pass


class Stream:
    def wait_event(self, event):
        pass


def test_a_cuda_out_of_memory_error_in_acquire_leaves_the_weights_unused(monkeypatch):
    out_of_memory = [True]
    real_empty = torch.empty

    def empty(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            if out_of_memory[0]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 KiB")
            device = None  # the "device" copy is a CPU tensor here
        return real_empty(*args, device=device, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(cuda_copy, "copy_stream", lambda device, direction="to_device": Stream())
    monkeypatch.setattr(cuda_copy, "copy_async", lambda dst, src, stream, wait_for=None, hold=True: DoneEvent())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)

    slots = [Slot(i, f"t{i}", real_empty(n, dtype=torch.uint8, device="meta"), True)
             for i, n in enumerate((4096, 1000))]
    record = Record(0, slots, [])
    pack([record])
    fetcher = Fetcher([record], torch.device("cuda", 0), hosts={record: torch.zeros(record.nbytes, dtype=torch.uint8)})
    for _ in range(2):  # the first fails as the fetch starts, the second in acquire's own copy to the device
        with pytest.raises(torch.OutOfMemoryError):
            fetcher.acquire(record)
    assert all(f.users == 0 for f in fetcher.fetches.values())
    out_of_memory[0] = False  # memory freed: the retry runs
    fetch = fetcher.acquire(record)
    assert fetch.users == 1
    fetcher.release(fetch)
    assert all(f.users == 0 for f in fetcher.fetches.values())  # nothing in use once the module is done
    fetcher.drain()
