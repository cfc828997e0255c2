"""Nothing kept or left behind after a failure: observed futures are released by their handle (no rescans of
every pending future per submit), a write that fails at open leaves no empty file, clear errors for sparse
tensors."""
import gc
import os
import weakref

import pytest
import torch

import swapio
from conftest import TIMEOUT, wait_handle


def _fail_and_observe(h, path):
    """A read past the end of `path`, waited on and its error handled; returns a weak reference to its buffer."""
    buf = torch.empty(1 << 20, dtype=torch.uint8)
    ref = weakref.ref(buf)
    future = h.pread(buf, path)
    with pytest.raises(OSError):
        future.wait(TIMEOUT)
    return ref


def test_observed_failures_are_released_by_the_handle(handle_factory, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    h = handle_factory(direct=False)
    refs = [_fail_and_observe(h, path) for _ in range(20)]
    gc.collect()
    assert all(r() is None for r in refs)  # no traceback -> frame -> buffer kept alive by the handle
    assert wait_handle(h) == 0  # errors already raised to their callers are not raised again


def test_submit_does_not_rescan_every_pending_future(handle_factory, tmp_path, monkeypatch):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    h = handle_factory(direct=False)
    calls = {"n": 0}
    real_done = swapio.Future.done

    def done(self):
        calls["n"] += 1
        return real_done(self)

    monkeypatch.setattr(swapio.Future, "done", done)
    n = 2000
    futures = [h.pread(torch.empty(8, dtype=torch.uint8), path, 4096) for _ in range(n)]  # all fail, unobserved
    assert calls["n"] <= 10 * n  # amortised O(1) per submit, not O(pending)
    with pytest.raises(OSError):
        wait_handle(h)
    assert all(f.done() for f in futures)


def test_write_failing_at_open_leaves_no_empty_file(handle_factory, ramfs_dir):
    h = handle_factory(direct=True)
    target = ramfs_dir / "refused.bin"
    with pytest.raises(OSError):
        h.pwrite(torch.zeros(4096, dtype=torch.uint8), target)
    assert not target.exists()


def test_write_failing_at_open_keeps_an_existing_file(handle_factory, ramfs_dir):
    h = handle_factory(direct=True)
    target = ramfs_dir / "existing.bin"
    target.write_bytes(b"")
    with pytest.raises(OSError):
        h.pwrite(torch.zeros(4096, dtype=torch.uint8), target)
    assert target.exists()  # not ours to remove


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensor_is_value_error_naming_the_layout(handle_factory, tmp_path, layout):
    dense = torch.eye(4)
    t = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    h = handle_factory()
    with pytest.raises(ValueError, match="sparse.*to_dense"):
        h.pwrite(t, tmp_path / "s.bin")
    store = swapio.SwapStore(tmp_path / "store")
    with pytest.raises(ValueError, match="sparse.*to_dense"):
        store.swap_out(t)
    store.close()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_nested_tensor_is_value_error_saying_so(handle_factory, tmp_path, layout):
    # strided: torch's "Internal error: NestedTensorImpl doesn't support sizes"; jagged: called sparse, with advice
    # (.to_dense()) a nested tensor lacks
    t = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=getattr(torch, layout))
    h = handle_factory()
    for call in (lambda: h.pwrite(t, tmp_path / "s.bin"), lambda: h.pread(t, tmp_path / "s.bin")):
        with pytest.raises(ValueError, match=r"nested tensor.*\.unbind\(\)"):
            call()
    assert not (tmp_path / "s.bin").exists()
    with swapio.SwapStore(tmp_path / "store") as store:
        with pytest.raises(ValueError, match=r"nested tensor.*\.unbind\(\)"):
            store.swap_out(t, release=False)
        assert len(store) == 0
