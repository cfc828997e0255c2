"""empty_pinned: page-aligned host tensors, tracked so that views count as pinned, returned to the OS when the
last tensor using them dies."""
import gc
import weakref

import pytest
import torch

import swapio
from conftest import TIMEOUT, random_bytes, read_file, as_bytes


def live_blocks():
    return len(swapio.core.pinned._ends)


@pytest.mark.parametrize("shape,dtype", [((1,), torch.uint8), ((4095,), torch.uint8), ((1000, 3), torch.float32),
                                         ((7, 5, 3), torch.bfloat16), (12345, torch.complex64)],
                         ids=["1B", "4095B", "2d-float32", "3d-bf16", "int-shape-complex64"])
def test_empty_pinned_is_page_aligned_with_requested_shape_and_dtype(shape, dtype):
    t = swapio.empty_pinned(shape, dtype)
    assert t.data_ptr() % 4096 == 0
    assert t.shape == (shape if isinstance(shape, tuple) else (shape,))
    assert t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert swapio.is_pinned(t)


def test_empty_pinned_default_dtype_is_float32():
    assert swapio.empty_pinned((3,)).dtype == torch.float32


def test_empty_pinned_memory_is_writable_end_to_end():
    t = swapio.empty_pinned((3 * 4096 + 5,), torch.uint8)
    src = random_bytes(3 * 4096 + 5)
    t.copy_(src)
    assert torch.equal(t, src)


def test_empty_pinned_zero_elements_gives_empty_tensor():
    t = swapio.empty_pinned((0, 4), torch.float32)
    assert t.shape == (0, 4) and t.numel() == 0


@pytest.mark.parametrize("bad", [(-1,), (2.5,), ("3",)], ids=["negative", "float", "str"])
def test_empty_pinned_rejects_bad_shape(bad):
    with pytest.raises((TypeError, ValueError)):
        swapio.empty_pinned(bad, torch.float32)


@pytest.mark.parametrize("size", ["np.int64", "np.uint8"])
def test_empty_pinned_takes_a_numpy_integer_size_as_torch_empty_does(size):
    # (TypeError: "'numpy.int64' object is not iterable")
    np = pytest.importorskip("numpy")
    n = getattr(np, size.split(".")[1])(3)
    assert swapio.empty_pinned(n).shape == torch.empty(n).shape == (3,)
    assert swapio.is_pinned(swapio.empty_pinned(n))


def test_empty_pinned_rejects_non_dtype():
    with pytest.raises(TypeError):
        swapio.empty_pinned((4,), "float32")


def test_views_of_pinned_tensor_count_as_pinned():
    t = swapio.empty_pinned((64, 64), torch.float32)
    for view in (t[1:], t[10:20, 3:7], t.view(-1)[4095:], t.t(), t[-1, -1], t.view(torch.uint8)[1:]):
        assert swapio.is_pinned(view)


def test_ordinary_tensors_are_not_pinned():
    assert not swapio.is_pinned(torch.empty(4096, dtype=torch.uint8))
    assert not swapio.is_pinned(torch.empty(16, device="meta"))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_is_pinned_of_a_sparse_tensor_is_torchs_answer(layout):
    # (RuntimeError: "Cannot access data pointer of Tensor that doesn't have storage")
    t = getattr(torch.eye(3), "to_" + layout)()
    assert swapio.is_pinned(t) is False and t.is_pinned() is False


def test_memory_just_past_a_pinned_block_is_not_pinned():
    t = swapio.empty_pinned((4096,), torch.uint8)
    other = torch.empty(1 << 16, dtype=torch.uint8)
    if t.data_ptr() <= other.data_ptr() < t.data_ptr() + 4096:
        pytest.skip("allocator placed the tensor inside the block's page")  # impossible, but be safe
    assert not swapio.is_pinned(other)


@pytest.mark.slow
def test_pinned_memory_is_released_when_last_tensor_dies():
    gc.collect()
    before = live_blocks()
    t = swapio.empty_pinned((1 << 16,), torch.float32)
    ref = weakref.ref(t)
    ptr = t.data_ptr()
    assert live_blocks() == before + 1
    del t
    gc.collect()
    assert ref() is None
    assert live_blocks() == before
    assert ptr not in swapio.core.pinned._ends


@pytest.mark.slow
def test_view_keeps_pinned_memory_alive():
    gc.collect()
    before = live_blocks()
    t = swapio.empty_pinned((4096,), torch.uint8)
    t.fill_(9)
    view = t[100:200]
    del t
    gc.collect()
    assert live_blocks() == before + 1
    assert swapio.is_pinned(view)
    assert bool((view == 9).all())
    del view
    gc.collect()
    assert live_blocks() == before


@pytest.mark.slow
def test_many_pinned_allocations_do_not_accumulate():
    gc.collect()
    before = live_blocks()
    for _ in range(200):
        swapio.empty_pinned((8192,), torch.uint8).fill_(1)
    gc.collect()
    assert live_blocks() == before


def test_pinned_tensor_roundtrips_through_o_direct(tmp_path):
    with swapio.AioHandle(direct=True) as h:
        t = swapio.empty_pinned((1 << 18,), torch.float32)
        t.view(torch.uint8).copy_(random_bytes(1 << 20, seed=31))
        path = tmp_path / "p.bin"
        assert h.pwrite(t, path).wait(timeout=TIMEOUT) == 1 << 20
        assert read_file(path) == as_bytes(t)
        out = swapio.empty_pinned((1 << 18,), torch.float32)
        assert h.pread(out, path).wait(timeout=TIMEOUT) == 1 << 20
        assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_pinned_block_larger_than_memlock_limit_still_works():
    """Above RLIMIT_MEMLOCK, the memory is used unlocked (with a warning), not refused."""
    limit = swapio.info()["memlock_limit"]
    if limit is None or limit > 256 << 20:
        pytest.skip("RLIMIT_MEMLOCK is unlimited or large here")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", swapio.SwapioWarning)
        t = swapio.empty_pinned((limit + 4096,), torch.uint8)
    t.fill_(3)
    assert t.data_ptr() % 4096 == 0 and bool((t[-10:] == 3).all())
    assert swapio.is_pinned(t)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_in_a_blocks_release_is_delivered_after_it_and_leaves_the_registry_right(monkeypatch):
    """A Ctrl-C that lands while a freed block's release hook runs: the hook finishes (the block leaves the registry
    before its memory goes), the KeyboardInterrupt comes right after, and a new block at that address is found
    and released right. (The interrupted hook's Ctrl-C was dropped, the block stayed registered, and the next block
    mapped at its address made the registry raise KeyError on every lookup.)"""
    pinned = swapio.core.pinned
    real, calls = pinned._unregister, []

    def ctrl_c_at_first(start):
        calls.append(start)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(start)

    monkeypatch.setattr(pinned, "_unregister", ctrl_c_at_first)
    t = swapio.empty_pinned((1 << 20,), torch.uint8)
    start = t.data_ptr()
    with pytest.raises(KeyboardInterrupt):  # delivered within a few bytecodes, as a real Ctrl-C
        del t
        for _ in range(3):
            pass
    assert calls == [start, start]
    assert start not in pinned._ends and start not in pinned._starts
    monkeypatch.undo()
    for _ in range(3):  # the same size again: mapped at that address as a rule
        u = swapio.empty_pinned((1 << 20,), torch.uint8)
        assert swapio.is_pinned(u[7:]) and pinned._block_of(u.data_ptr() + 7)[0] == u.data_ptr()
        del u
    assert not swapio.is_pinned(torch.empty(4)) and pinned._starts == sorted(pinned._ends)


def test_a_block_that_died_registered_is_replaced_by_the_next_at_its_address():
    """If a block's release never ran (its memory gone, its entry left), the next block mapped at that address takes
    the entry over: one entry, found by lookups, gone when that block is freed."""
    pinned = swapio.core.pinned
    t = swapio.empty_pinned((1 << 20,), torch.uint8)
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    del t
    pinned._register(start, end)  # as if the release had never run
    before = len(pinned._starts)
    pinned._register(start, end)  # the next block at that address
    assert len(pinned._starts) == before and pinned._starts.count(start) == 1
    assert pinned._block_of(start + 1) == (start, end)
    assert not pinned._unregister(start)
    assert pinned._block_of(start + 1) is None and start not in pinned._starts and start not in pinned._ends
    assert not swapio.is_pinned(torch.empty(4))


@pytest.mark.parametrize("value", [[1.0], bytearray(8), None], ids=["list", "bytearray", "None"])
def test_is_pinned_of_a_non_tensor_is_a_type_error(value):
    """torch's own Tensor.is_pinned is a method: a non-tensor given here was an AttributeError on '.device'."""
    with pytest.raises(TypeError, match="torch.Tensor"):
        swapio.is_pinned(value)
