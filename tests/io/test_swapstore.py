"""SwapStore / SwappedTensor: swap-out writes exactly the tensor's bytes to <dir>/<name>.swap (0600, no symlink
following), release frees the storage, swap-in brings the bytes back (refilling the released tensor), and
close() cleans up."""
import errno
import os
import stat

import pytest
import torch

import swapio
from conftest import TIMEOUT, as_bytes, random_bytes, read_file


@pytest.fixture
def store(tmp_path):
    s = swapio.SwapStore(tmp_path / "swap")
    yield s
    s.close()


def sample(dtype=torch.float32, shape=(33, 129), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
                                   torch.complex64], ids=lambda d: str(d).replace("torch.", ""))
def test_swap_out_release_frees_storage_and_swap_in_refills_it(store, dtype):
    t = sample(dtype)
    expected = t.clone()
    s = store.swap_out(t, name="x")
    assert s.wait(timeout=TIMEOUT) is s
    assert t.untyped_storage().nbytes() == 0
    assert not s.is_resident
    assert (s.shape, s.dtype, s.device, s.nbytes) == (expected.shape, dtype, torch.device("cpu"),
                                                      expected.numel() * expected.element_size())
    back = s.swap_in().wait(timeout=TIMEOUT)
    assert s.is_resident
    # The original tensor object holds its data again, and the returned tensor is that same memory.
    assert t.untyped_storage().nbytes() == s.nbytes
    assert as_bytes(t) == as_bytes(expected)
    assert back.data_ptr() == t.data_ptr()
    assert back.shape == expected.shape and back.dtype == dtype
    assert as_bytes(back) == as_bytes(expected)


def test_swap_in_returns_the_released_tensor_object_itself(store):
    t = sample()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    assert s.swap_in().wait(timeout=TIMEOUT) is t


def test_swap_file_holds_exactly_the_tensor_bytes(store):
    t = sample(torch.bfloat16, (7, 13, 5))
    expected = as_bytes(t)
    s = store.swap_out(t, name="exact")
    s.wait(timeout=TIMEOUT)
    assert os.path.getsize(s.path) == len(expected) == s.nbytes
    assert read_file(s.path) == expected


def test_swap_out_release_false_keeps_tensor_resident(store):
    t = sample()
    expected = t.clone()
    s = store.swap_out(t, name="keep", release=False)
    s.wait(timeout=TIMEOUT)
    assert s.is_resident
    assert t.untyped_storage().nbytes() == expected.numel() * 4
    assert torch.equal(t, expected)
    assert read_file(s.path) == as_bytes(expected)
    back = s.swap_in().wait(timeout=TIMEOUT)
    assert back is not t and torch.equal(back, expected)


def test_remove_after_swap_in_keeps_the_swapped_in_tensor(store):
    t = sample()
    expected = t.clone()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    back = s.swap_in().wait(timeout=TIMEOUT)
    store.remove(s)
    assert t.untyped_storage().nbytes() == expected.numel() * 4, "remove() freed the swapped-in tensor"
    assert torch.equal(back, expected)


def test_close_after_swap_in_keeps_the_swapped_in_tensor(tmp_path):
    store = swapio.SwapStore(tmp_path / "swap")
    t = sample()
    expected = t.clone()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    back = s.swap_in().wait(timeout=TIMEOUT)
    store.close()
    assert t.untyped_storage().nbytes() == expected.numel() * 4, "close() freed the swapped-in tensor"
    assert torch.equal(back, expected)


def test_wait_again_after_swap_in_keeps_the_tensor(store):
    t = sample()
    expected = t.clone()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    s.swap_in().wait(timeout=TIMEOUT)
    s.wait(timeout=TIMEOUT)
    assert s.is_resident
    assert torch.equal(t, expected)


def test_swap_in_twice_gives_the_data_both_times(store):
    t = sample(seed=3)
    expected = t.clone()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    first = s.swap_in().wait(timeout=TIMEOUT)
    assert torch.equal(first, expected)
    second = s.swap_in().wait(timeout=TIMEOUT)
    assert torch.equal(second, expected)


@pytest.mark.parametrize("release", [True, False], ids=["release", "keep"])
def test_non_contiguous_tensor_roundtrips_in_logical_order(store, release):
    base = sample(shape=(64, 48))
    t = base.t()  # spans its whole storage, but is not contiguous
    expected = t.clone()
    s = store.swap_out(t, name="transposed", release=release)
    s.wait(timeout=TIMEOUT)
    assert read_file(s.path) == as_bytes(expected)  # logical (row-major) order of the transposed tensor
    back = s.swap_in().wait(timeout=TIMEOUT)
    assert torch.equal(back, expected)
    assert back.shape == expected.shape


@pytest.mark.parametrize("make", [lambda t: t.to(memory_format=torch.channels_last), lambda t: t.transpose(0, 1),
                                  lambda t: t[:, :2], lambda t: t[:, :1].expand(2, 3, 4, 5)],
                         ids=["channels_last", "transposed", "view", "expanded"])
def test_swap_in_to_a_new_tensor_keeps_the_layout_as_clone_does(store, make):
    # swap_in(device=...) of a kept tensor makes a new one: it has torch's .clone() strides (a dense layout kept,
    # anything else contiguous), not always contiguous ones (a channels_last conv input came back NCHW)
    t = make(sample(shape=(2, 3, 4, 5)))
    s = store.swap_out(t, name="t", release=False).wait(timeout=TIMEOUT)
    back = s.swap_in(device="cpu").wait(timeout=TIMEOUT)
    assert back.data_ptr() != t.data_ptr()
    assert torch.equal(back, t)
    assert back.stride() == t.clone().stride()


def test_release_of_view_into_larger_storage_is_value_error(store):
    base = sample(shape=(10, 10))
    with pytest.raises(ValueError, match="release"):
        store.swap_out(base[2:5], name="v")
    assert "v" not in store
    s = store.swap_out(base[2:5], name="v", release=False)  # allowed without release
    s.wait(timeout=TIMEOUT)
    assert read_file(s.path) == as_bytes(base[2:5])
    assert base.untyped_storage().nbytes() == 400


def test_default_names_are_stable_and_files_named_after_them(store):
    a = store.swap_out(sample(seed=1), release=False)
    b = store.swap_out(sample(seed=2), release=False)
    a.wait(timeout=TIMEOUT)
    b.wait(timeout=TIMEOUT)
    assert (a.name, b.name) == ("tensor0", "tensor1")
    assert a.path == os.path.join(store.directory, "tensor0.swap")
    assert b.path == os.path.join(store.directory, "tensor1.swap")
    assert "tensor0" in store and store["tensor1"] is b and len(store) == 2


def test_explicit_name_gives_name_dot_swap(store):
    s = store.swap_out(sample(), name="layer.3-weight_v2", release=False)
    s.wait(timeout=TIMEOUT)
    assert os.path.basename(s.path) == "layer.3-weight_v2.swap"
    assert os.path.dirname(s.path) == store.directory


def test_swap_file_mode_is_0600(store):
    s = store.swap_out(sample(), name="private", release=False)
    s.wait(timeout=TIMEOUT)
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600


def test_swap_file_mode_is_0600_even_with_permissive_umask(store):
    old = os.umask(0)
    try:
        s = store.swap_out(sample(), name="private", release=False)
        s.wait(timeout=TIMEOUT)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600


def test_duplicate_name_is_value_error(store):
    store.swap_out(sample(), name="dup", release=False).wait(timeout=TIMEOUT)
    with pytest.raises(ValueError, match="dup"):
        store.swap_out(sample(), name="dup", release=False)


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "-dash", "", "x" * 201, "sp ace", "w\n"],
                         ids=["dotdot", "slash", "dot-first", "dash-first", "empty", "too-long", "space",
                              "trailing-newline"])  # (the pattern's "$" let "w\n" through: a file "w\n.swap")
def test_unsafe_name_is_value_error(store, name):
    with pytest.raises(ValueError):
        store.swap_out(sample(), name=name, release=False)
    assert [n for n in os.listdir(store.directory) if n != ".swapio-owner"] == []


@pytest.mark.parametrize("name", [3, b"w", ("w",)], ids=["int", "bytes", "tuple"])
def test_a_name_that_is_not_a_str_is_a_type_error(store, name):
    with pytest.raises(TypeError, match="must be a str"):
        store.swap_out(sample(), name=name, release=False)
    assert [n for n in os.listdir(store.directory) if n != ".swapio-owner"] == []


def test_symlink_at_target_name_is_not_followed(store, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"do not touch")
    link = os.path.join(store.directory, "linked.swap")
    os.symlink(victim, link)
    t = sample()
    expected = t.clone()
    try:
        s = store.swap_out(t, name="linked", release=False)
        s.wait(timeout=TIMEOUT)
    except OSError as exc:
        assert exc.errno in (errno.ELOOP, errno.EEXIST)
        assert "linked" not in store
    else:  # replacing the link is fine too, as long as nothing went through it
        assert not os.path.islink(s.path)
        assert read_file(s.path) == as_bytes(expected)
    assert read_file(victim) == b"do not touch"
    assert torch.equal(t, expected)


def test_release_of_tensor_with_non_resizable_storage_fails_cleanly(tmp_path):
    """torch cannot resize storage borrowed from numpy: swap_out(release=True) must refuse it up front
    (ValueError) or cope, never fail at wait() after the write, nor leave files behind at close()."""
    np = pytest.importorskip("numpy")
    t = torch.from_numpy(np.arange(1000, dtype=np.float32))
    other = torch.arange(10.0)
    store = swapio.SwapStore(tmp_path / "swap")
    store.swap_out(other, name="other", release=False).wait(timeout=TIMEOUT)
    try:
        s = store.swap_out(t, name="np")
    except ValueError:
        pass  # refused up front: fine
    else:
        s.wait(timeout=TIMEOUT)
        assert read_file(s.path) == as_bytes(torch.arange(1000, dtype=torch.float32))
    finally:
        store.close()
    assert not (tmp_path / "swap").exists(), os.listdir(tmp_path / "swap")


def test_swap_in_out_of_wrong_shape_is_value_error(store):
    s = store.swap_out(sample(shape=(4, 8)), name="s", release=False)
    s.wait(timeout=TIMEOUT)
    with pytest.raises(ValueError, match="expected"):
        s.swap_in(out=torch.empty(8, 4))


def test_swap_in_out_of_wrong_dtype_is_value_error(store):
    s = store.swap_out(sample(shape=(4, 8)), name="s", release=False)
    s.wait(timeout=TIMEOUT)
    with pytest.raises(ValueError):
        s.swap_in(out=torch.empty(4, 8, dtype=torch.float64))


def test_swap_in_out_of_non_tensor_is_type_error(store):
    s = store.swap_out(sample(), name="s", release=False)
    s.wait(timeout=TIMEOUT)
    with pytest.raises(TypeError):
        s.swap_in(out=[0.0])


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_swap_in_into_out_fills_it(store, contiguous):
    t = sample(shape=(6, 10), seed=5)
    expected = t.clone()
    s = store.swap_out(t, name="o")
    s.wait(timeout=TIMEOUT)
    out = torch.zeros(6, 10) if contiguous else torch.zeros(10, 6).t()
    back = s.swap_in(out=out).wait(timeout=TIMEOUT)
    assert back is out
    assert torch.equal(out, expected)


def test_swap_in_to_explicit_cpu_device(store):
    t = sample(seed=6)
    expected = t.clone()
    s = store.swap_out(t, release=False)
    s.wait(timeout=TIMEOUT)
    back = s.swap_in(device="cpu").wait(timeout=TIMEOUT)
    assert back.device == torch.device("cpu") and torch.equal(back, expected)


def test_swap_in_waits_for_pending_swap_out(store):
    t = torch.arange(4 << 20, dtype=torch.int32)
    expected = t.clone()
    s = store.swap_out(t)  # not waited on
    back = s.swap_in().wait(timeout=TIMEOUT)
    assert torch.equal(back, expected)


def test_zero_element_tensor_roundtrips(store):
    t = torch.empty(0, 5)
    s = store.swap_out(t, name="empty")
    s.wait(timeout=TIMEOUT)
    assert os.path.getsize(s.path) == 0
    back = s.swap_in().wait(timeout=TIMEOUT)
    assert back.shape == (0, 5)


def test_remove_deletes_file_and_forgets_name(store):
    s = store.swap_out(sample(), name="gone", release=False)
    s.wait(timeout=TIMEOUT)
    store.remove(s)
    assert not os.path.exists(s.path)
    assert "gone" not in store
    store.swap_out(sample(), name="gone", release=False).wait(timeout=TIMEOUT)  # the name is free again


def test_remove_of_foreign_swapped_tensor_is_value_error(tmp_path, store):
    with swapio.SwapStore(tmp_path / "other") as other:
        s = other.swap_out(sample(), release=False)
        s.wait(timeout=TIMEOUT)
        with pytest.raises(ValueError):
            store.remove(s)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)], ids=repr)
def test_swap_in_to_cpu_with_an_index_refills_the_released_source(store, device):
    # ("cpu:0" is the device of the CPU tensors torch makes, but compared unequal to theirs: a new tensor was
    # returned and the source stayed released)
    t = torch.arange(6.0)
    s = store.swap_out(t).wait(timeout=TIMEOUT)
    back = s.swap_in(device=device).result(timeout=TIMEOUT)
    assert s.is_resident  # first: reading a released tensor (pytest's repr of it too) is a segfault in torch
    assert id(back) == id(t) and torch.equal(t, torch.arange(6.0))


@pytest.mark.parametrize("other", ["kept", 3, None, torch.ones(2)], ids=["its name", "int", "None", "a tensor"])
def test_remove_of_something_else_is_a_type_error_and_removes_nothing(store, other):
    # (an AttributeError: 'str' object has no attribute 'name')
    s = store.swap_out(sample(), name="kept", release=False).wait(timeout=TIMEOUT)
    by_name = r".*remove\(store\['kept'\]\)" if other == "kept" else ""
    with pytest.raises(TypeError, match="SwappedTensor swap_out returned" + by_name):
        store.remove(other)
    assert "kept" in store and os.path.exists(s.path)


def test_close_removes_files_and_created_directory(tmp_path):
    directory = tmp_path / "made-by-store"
    store = swapio.SwapStore(directory)
    paths = [store.swap_out(sample(seed=i), release=False).wait(timeout=TIMEOUT).path for i in range(3)]
    assert all(os.path.exists(p) for p in paths)
    store.close()
    assert not any(os.path.exists(p) for p in paths)
    assert not directory.exists()


def test_close_keeps_existing_directory_and_foreign_files(tmp_path):
    directory = tmp_path / "existing"
    directory.mkdir()
    (directory / "foreign.txt").write_text("mine")
    store = swapio.SwapStore(directory)
    s = store.swap_out(sample(), release=False)
    s.wait(timeout=TIMEOUT)
    store.close()
    assert directory.is_dir()
    assert not os.path.exists(s.path)
    assert (directory / "foreign.txt").read_text() == "mine"


def test_close_waits_for_pending_swap_outs(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    tensors = [torch.full((1 << 20,), float(i)) for i in range(4)]
    for t in tensors:
        store.swap_out(t, release=False)
    store.close()
    assert not (tmp_path / "s").exists()


def test_closed_store_rejects_swap_out(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.swap_out(sample())


def test_remove_after_close_says_the_store_is_closed(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    s = store.swap_out(sample())
    store.close()
    assert not os.path.exists(s.path)
    with pytest.raises(ValueError, match="SwapStore is closed"):
        store.remove(s)


def test_store_uses_given_handle(tmp_path):
    with swapio.AioHandle(engine="psync", block_size=4096) as h:
        with swapio.SwapStore(tmp_path / "s", handle=h) as store:
            assert store.handle is h
            t = sample()
            expected = t.clone()
            s = store.swap_out(t)
            s.wait(timeout=TIMEOUT)
            assert torch.equal(s.swap_in().wait(timeout=TIMEOUT), expected)
        assert not h.closed  # the store does not close a handle it was given


def test_store_rejects_handle_and_handle_kwargs_together(tmp_path):
    with swapio.AioHandle() as h:
        with pytest.raises(ValueError):
            swapio.SwapStore(tmp_path / "s", handle=h, block_size=4096)


def test_store_passes_handle_kwargs_through(tmp_path):
    with swapio.SwapStore(tmp_path / "s", engine="psync", block_size=8192) as store:
        assert store.handle.engine == "psync" and store.handle.block_size == 8192


def test_swap_out_of_non_tensor_is_type_error(store):
    with pytest.raises(TypeError):
        store.swap_out([1, 2, 3])


def test_many_tensors_swap_out_and_in_concurrently(store):
    tensors = [random_bytes(10000 + i * 517, seed=i) for i in range(40)]
    expected = [t.clone() for t in tensors]
    swapped = [store.swap_out(t) for t in tensors]
    for s in swapped:
        s.wait(timeout=TIMEOUT)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    futures = [s.swap_in() for s in swapped]
    for f, t, e in zip(futures, tensors, expected):
        f.wait(timeout=TIMEOUT)
        assert torch.equal(t, e)


def test_requires_grad_parameter_swaps_out_and_in(store):
    p = torch.nn.Parameter(sample(seed=9))
    expected = p.detach().clone()
    s = store.swap_out(p)
    s.wait(timeout=TIMEOUT)
    assert p.untyped_storage().nbytes() == 0
    s.swap_in().wait(timeout=TIMEOUT)
    assert torch.equal(p.detach(), expected)
    assert p.requires_grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_cuda_tensor_swaps_out_and_back_to_cuda(store):
    t = sample(seed=10).cuda()
    expected = t.cpu()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    assert read_file(s.path) == as_bytes(expected)
    back = s.swap_in().wait(timeout=TIMEOUT)
    assert back.device.type == "cuda" and torch.equal(back.cpu(), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 1)])
def test_swap_in_to_cuda_without_cuda_is_a_runtime_error_saying_so(store, device):
    """docs/io.md's swap_in(device="cuda") on a machine without CUDA: a RuntimeError naming the device and the
    CPU instead (torch's AssertionError "Torch not compiled with CUDA enabled" before); the tensor stays swapped
    out and swaps in to the CPU."""
    t = sample(seed=11)
    expected = t.clone()
    s = store.swap_out(t)
    s.wait(timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match=r"swap_in\(device=.*\) needs CUDA, but .*device='cpu'"):
        s.swap_in(device=device)
    assert not s.is_resident
    assert torch.equal(s.swap_in().wait(timeout=TIMEOUT), expected)
