"""The reuse of pinned blocks (swapio.core.pinned): PinnedPool hands a freed block out again for the same size,
never while a GPU copy may still use it, and gives its blocks back to the OS on clear(); GrowingBlock lets its old
block go before pinning a larger one, so the two never coexist."""
import gc

import torch

from swapio.core.pinned import GrowingBlock, PinnedPool, is_pinned, page_size, pinned_bytes, size_class
from test_cuda_staging import FakeEvent  # a GPU copy's completion event, completed when the test says so


def test_size_class_rounds_up_by_at_most_an_eighth_and_page_size_to_pages():
    for n in (1, 4096, 65537, 100_000, 3 << 20, (1 << 30) + 1):
        c = size_class(n)
        assert c >= max(n, 1 << 16) and (n < 1 << 16 or c <= n * 9 // 8)
        assert page_size(n) >= n and page_size(n) % 4096 == 0 and page_size(n) - n < 4096
    assert page_size(0) == 4096  # a block is at least a page


def test_pool_reuses_a_freed_block_of_the_same_size_and_counts_bytes():
    pool = PinnedPool()
    a = pool.alloc(10_000)
    assert is_pinned(a) and a.numel() == page_size(10_000) and pool.in_use == a.numel()
    ptr = a.data_ptr()
    pool.free(a)
    assert (pool.in_use, pool.cached) == (0, page_size(10_000))
    b = pool.alloc(9_000)  # the same page-rounded size: the same block
    assert b.data_ptr() == ptr and pool.cached == 0
    c = pool.alloc(100_000)  # another size: a new block
    assert c.data_ptr() != ptr
    pool.free(b)
    pool.free(c)
    pool.clear()


def test_pool_never_hands_out_a_block_a_copy_may_still_use():
    pool = PinnedPool(size_class)
    a = pool.alloc(70_000)
    event = FakeEvent()
    pool.free(a, event)
    b = pool.alloc(70_000)
    assert b.data_ptr() != a.data_ptr()  # the copy out of a has not completed
    event.finished = True
    c = pool.alloc(70_000)
    assert c.data_ptr() == a.data_ptr()
    pool.free(b)
    pool.free(c)
    pool.clear()


def test_pool_clear_waits_for_copies_and_gives_the_memory_back():
    gc.collect()
    before = pinned_bytes()[0]
    pool = PinnedPool()
    blocks = [pool.alloc(1 << 20) for _ in range(3)]
    event = FakeEvent()
    for i, b in enumerate(blocks):
        pool.free(b, event if i == 0 else None)
    del blocks, b
    assert pinned_bytes()[0] - before == 3 << 20  # kept for reuse
    pool.clear()
    assert event.synchronized == 1 and pool.cached == 0
    gc.collect()
    assert pinned_bytes()[0] == before


def test_growing_block_grows_to_the_largest_request_without_holding_two_blocks():
    gc.collect()
    grown = GrowingBlock()
    first = grown.at_least(5000)
    assert is_pinned(first) and grown.nbytes == page_size(5000)
    assert grown.at_least(100).data_ptr() == first.data_ptr()  # smaller: the same block
    assert grown.holds(first[10:20]) and not grown.holds(torch.empty(3))
    del first
    base, _ = pinned_bytes(reset_peak=True)
    bigger = grown.at_least(3 << 20)
    assert grown.nbytes == 3 << 20
    now, peak = pinned_bytes()
    assert now - base == (3 << 20) - page_size(5000) and peak == now  # the old block went first
    del bigger
    grown.release()
    gc.collect()
    assert grown.nbytes == 0 and pinned_bytes()[0] == base - page_size(5000)
