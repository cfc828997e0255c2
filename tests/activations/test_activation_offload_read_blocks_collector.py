"""The blocks that saved activations are read back into (ReadBlocks) return to their free list from a storage
finalizer. The garbage collector may run that finalizer inside one of ReadBlocks' own sections under its lock (an
allocation there starts it, and a read-back tensor caught in a reference cycle dies): with a plain Lock the
finalizer then waited for the lock its own thread held, and the backward hung for good (res.lock held too)."""
import bisect
import gc
import threading

import pytest

from swapio.offload import activation_blocks
from swapio.offload.activation_blocks import ReadBlocks

TIMEOUT = 30


def in_a_thread(fn):
    """fn's result; fails (instead of hanging the suite) if it does not return in time."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    assert out, "deadlocked: the finalizer waited for the lock its own thread held"
    return out[0]


def a_block_in_a_cycle(blocks, nbytes=8192):
    cycle = {"tensor": blocks.take(nbytes, 0)}  # a read-back tensor a traceback's frames hold, say
    cycle["self"] = cycle


@pytest.mark.parametrize("where", ["bisect_left", "insort"], ids=["taking-a-block", "giving-one-back"])
def test_a_block_freed_by_the_collector_inside_a_section_comes_back_without_deadlock(monkeypatch, where):
    blocks, collected = ReadBlocks(), []
    real = getattr(bisect, where)

    def collecting(*args, **kwargs):
        monkeypatch.setattr(activation_blocks.bisect, where, real)
        collected.append(gc.collect())  # the collector, started by an allocation in the section
        return real(*args, **kwargs)
    gc.disable()  # (so that it runs just there)
    try:
        kept = [blocks.take(4096, 0)]  # (given back below: the `insort` case's section)
        a_block_in_a_cycle(blocks)
        monkeypatch.setattr(activation_blocks.bisect, where, collecting)
        if where == "bisect_left":
            taken = in_a_thread(lambda: blocks.take(4096, 0))
            assert taken.numel() == 4096
            del taken
        in_a_thread(kept.clear)
        in_a_thread(lambda: blocks.take(1, 0))  # the lock is free again
    finally:
        gc.enable()
    assert collected and collected[0] > 0
    gc.collect()
    assert blocks.in_use == 0  # every block came back, counted once
    assert blocks.cached == sum(size for size, _, _ in blocks._free)
