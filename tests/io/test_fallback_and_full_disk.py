"""File systems that refuse O_DIRECT (ramfs: fallback to buffered I/O with a warning, or an error with
direct=True) and a full file system (ENOSPC at wait(), earlier files intact). Both need root to mount and skip
with the reason when the machine refuses."""
import errno
import os
import warnings

import pytest
import torch

import swapio
from conftest import ENGINE_PARAMS, MiB, TIMEOUT, as_bytes, random_bytes, read_file


def swapio_warnings(caught):
    return [w for w in caught if issubclass(w.category, swapio.SwapioWarning)]


# ---------------------------------------------------------------- ramfs: no O_DIRECT

def test_ramfs_refuses_o_direct_according_to_info(ramfs_dir):
    assert swapio.info(ramfs_dir)["path"]["direct"] is False


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_ramfs_direct_none_falls_back_with_warning_and_roundtrips(handle_factory, ramfs_dir, engine,
                                                                  fresh_warnings):
    h = handle_factory(engine=engine, direct=None, block_size=64 * 1024)
    src = random_bytes(MiB + 3, seed=21)
    path = ramfs_dir / "t.bin"
    with pytest.warns(swapio.SwapioWarning, match="O_DIRECT"):
        f = h.pwrite(src, path, 513)
    assert f.wait(timeout=TIMEOUT) == src.numel()
    data = read_file(path)
    assert len(data) == 513 + src.numel()
    assert data[513:] == as_bytes(src)
    out = torch.empty(MiB + 4, dtype=torch.uint8)[1:]
    assert h.pread(out, path, 513).wait(timeout=TIMEOUT) == src.numel()
    assert torch.equal(out, src)


def test_ramfs_fallback_warning_is_given_once_per_directory(handle_factory, ramfs_dir, fresh_warnings):
    h = handle_factory(direct=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            h.pwrite(random_bytes(100, seed=i), ramfs_dir / f"f{i}.bin").wait(timeout=TIMEOUT)
    assert len(swapio_warnings(caught)) == 1


@pytest.mark.parametrize("op", ["pwrite", "pread"])
def test_ramfs_direct_true_raises_einval_naming_o_direct(handle_factory, ramfs_dir, op):
    h = handle_factory(direct=True)
    path = ramfs_dir / "t.bin"
    path.write_bytes(b"r" * 4096)
    with pytest.raises(OSError) as info:
        getattr(h, op)(torch.zeros(4096, dtype=torch.uint8), path).wait(timeout=TIMEOUT)
    assert info.value.errno == errno.EINVAL
    assert "O_DIRECT" in str(info.value)
    assert info.value.filename == str(path)
    assert read_file(path) == b"r" * 4096  # nothing was written


def test_ramfs_direct_false_is_buffered_without_warning(handle_factory, ramfs_dir, fresh_warnings):
    h = handle_factory(direct=False)
    src = random_bytes(10000, seed=22)
    path = ramfs_dir / "t.bin"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert h.pwrite(src, path).wait(timeout=TIMEOUT) == 10000
    assert not swapio_warnings(caught)
    assert read_file(path) == as_bytes(src)


def test_ramfs_read_past_end_is_enodata_after_fallback(handle_factory, ramfs_dir):
    h = handle_factory(direct=None)
    path = ramfs_dir / "short.bin"
    path.write_bytes(b"s" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", swapio.SwapioWarning)
        f = h.pread(torch.empty(101, dtype=torch.uint8), path)
    with pytest.raises(OSError) as info:
        f.wait(timeout=TIMEOUT)
    assert info.value.errno == errno.ENODATA


def test_ramfs_swapstore_roundtrips_with_fallback(ramfs_dir):
    src = random_bytes(3 * 4096 + 7, seed=23).view(-1)
    expected = src.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", swapio.SwapioWarning)
        with swapio.SwapStore(ramfs_dir / "store") as store:
            s = store.swap_out(src, name="r")
            s.wait(timeout=TIMEOUT)
            assert read_file(s.path) == as_bytes(expected)
            back = s.swap_in().wait(timeout=TIMEOUT)
            assert torch.equal(back, expected)
            assert torch.equal(src, expected)  # the released tensor itself is refilled


# ---------------------------------------------------------------- full disk

def fill_with_files(h, directory, count=3, size=4 * MiB):
    """Writes `count` files that fit; returns {path: bytes written}."""
    written = {}
    for i in range(count):
        src = random_bytes(size, seed=100 + i)
        path = directory / f"keep{i}.bin"
        assert h.pwrite(src, path).wait(timeout=TIMEOUT) == size
        written[path] = as_bytes(src)
    return written


def assert_intact(h, written):
    for path, data in written.items():
        assert read_file(path) == data, f"{path.name} changed"
        out = torch.empty(len(data), dtype=torch.uint8)
        assert h.pread(out, path).wait(timeout=TIMEOUT) == len(data)
        assert out.numpy().tobytes() == data


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("direct", [None, False], ids=lambda d: f"direct{d}")
def test_write_larger_than_free_space_is_enospc_and_keeps_other_files(handle_factory, small_ext4_dir, engine,
                                                                      direct):
    h = handle_factory(engine=engine, direct=direct, block_size=MiB)
    written = fill_with_files(h, small_ext4_dir)
    big = small_ext4_dir / "too-big.bin"
    f = h.pwrite(random_bytes(64 * MiB, seed=1), big)  # the error comes at wait(), not at the call
    with pytest.raises(OSError) as info:
        f.wait(timeout=TIMEOUT)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(big)
    assert isinstance(info.value.offset, int) and 0 <= info.value.offset < 64 * MiB
    assert_intact(h, written)


def test_enospc_is_reported_by_handle_wait_when_future_dropped(handle_factory, small_ext4_dir):
    from conftest import wait_handle
    h = handle_factory(block_size=MiB)
    h.pwrite(random_bytes(64 * MiB, seed=2), small_ext4_dir / "too-big.bin")
    with pytest.raises(OSError) as info:
        wait_handle(h)
    assert info.value.errno == errno.ENOSPC


def test_enospc_from_unaligned_write(handle_factory, small_ext4_dir):
    """Unaligned memory and offset: the bounce-buffer and buffered-edge paths report ENOSPC too."""
    h = handle_factory(block_size=MiB)
    written = fill_with_files(h, small_ext4_dir, count=2)
    src = torch.empty(64 * MiB + 2, dtype=torch.uint8)[1:]
    src.fill_(7)
    f = h.pwrite(src, small_ext4_dir / "too-big.bin", 4097)
    with pytest.raises(OSError) as info:
        f.wait(timeout=TIMEOUT)
    assert info.value.errno == errno.ENOSPC
    assert_intact(h, written)


def test_swapstore_swap_out_larger_than_free_space_is_enospc(small_ext4_dir):
    store = swapio.SwapStore(small_ext4_dir / "store")
    try:
        keep = random_bytes(4 * MiB, seed=3)
        expected = keep.clone()
        s_keep = store.swap_out(keep, name="keep", release=False)
        s_keep.wait(timeout=TIMEOUT)
        big = torch.ones(64 * MiB, dtype=torch.uint8)
        s_big = store.swap_out(big, name="big", release=True)
        with pytest.raises(OSError) as info:
            s_big.wait(timeout=TIMEOUT)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == s_big.path
        # A failed swap-out must not free the only copy of the tensor.
        assert s_big.is_resident
        assert big.untyped_storage().nbytes() == 64 * MiB
        assert bool((big == 1).all())
        assert read_file(s_keep.path) == as_bytes(expected)
        back = s_keep.swap_in().wait(timeout=TIMEOUT)
        assert torch.equal(back, expected)
        try:
            store.remove(s_big)  # may re-raise the swap-out's error; the file goes either way
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        assert not os.path.exists(s_big.path)
    finally:
        try:
            store.close()
        except OSError:
            pass
