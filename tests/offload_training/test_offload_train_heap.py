"""Host memory while gradients come and go: glibc keeps the free blocks gradients leave in its heap (its mmap
threshold rises to the largest block freed, so blocks of a few MiB come from the heap); training offloaded
weights gives those pages back every 64 MiB of gradients (core/heap.py), so peak RSS follows the live tensors
and not the model's depth (benchmarks/offload_training.py --memory measures that on a Llama)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from swapio.core import heap
from swapio.offload.api import _offloaded
from helpers.offload_training import MLP, batches, build_opt, make_model, offload, train
from helpers.rss_child import PRELUDE

pytestmark = pytest.mark.skipif(heap._malloc_trim is None, reason="the C library has no malloc_trim (not glibc)")

CHILD = PRELUDE + textwrap.dedent("""
    import sys
    import torch
    from swapio.core.heap import HeapTrim

    def rss():
        return status("VmRSS")

    block = torch.empty(30 << 18)
    del block                    # a 30 MiB block freed: glibc's mmap threshold rises to 30 MiB
    base = rss()
    big, small = [], []
    for _ in range(128):         # 2 MiB blocks from the heap, each followed by a 64 KiB block that stays
        big.append(torch.ones(1 << 19))
        small.append(torch.ones(1 << 14))  # 64 KiB: from the top of the heap, right after
    del big                      # 256 MiB free between the small blocks: not at the heap's top
    kept = rss() - base
    HeapTrim(every=1).freed(1)
    print(kept >> 20, (rss() - base) >> 20)
""")


def test_a_trim_gives_the_free_heap_back():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    kept, after = map(int, out.split())
    assert kept >= 200  # glibc kept the freed blocks mapped
    assert after <= kept - 200  # and gave them back at the trim


def test_backward_of_offloaded_weights_trims_the_heap(tmp_path):
    model = offload(make_model(), "disk", tmp_path)
    training = _offloaded[model].training
    training.heap.every = 1  # every gradient (the model is small)
    with build_opt("AdamW", model.parameters(), str(tmp_path / "s"), offload="nvme") as opt:
        train(model, opt, batches(MLP, 2))
    assert training.heap.trims >= 2 * sum(1 for p in model.parameters() if p.requires_grad)
