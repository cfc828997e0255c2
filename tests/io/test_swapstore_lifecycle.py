"""A SwapStore's directory across its lifecycle in a long-running process (a sweep that builds and drops stores
in a loop): a store dropped without close(), or whose construction or close() a Ctrl-C cut short, leaves neither
its lock held, nor its lock file, swap files or descriptor behind, and the next store on the directory works.

Tests named test_bug_* each caught a bug (their docstrings say which).
"""
import gc
import os

import pytest
import torch

import swapio
from swapio.core import _swapdir
from conftest import TIMEOUT, open_fds
from helpers.ctrl_c import ctrl_c_on_call


def _use(directory):
    """A store on directory with one tensor swapped out and back: a SwappedTensor, which holds its store."""
    store = swapio.SwapStore(directory)
    swapped = store.swap_out(torch.arange(1000.0), name="w").wait(TIMEOUT)
    assert torch.equal(swapped.swap_in().wait(TIMEOUT), torch.arange(1000.0))
    return swapped


def _assert_reusable(directory):
    store = swapio.SwapStore(directory)
    store.swap_out(torch.ones(10), name="w").wait(TIMEOUT)
    store.close()
    assert not os.path.exists(directory)


def test_bug_a_dropped_store_does_not_keep_the_next_one_off_its_directory(tmp_path):
    """BUG: a store and its swapped tensors form a reference cycle, so a store dropped without close() kept its
    directory's lock (and its files) until the garbage collector happened to run: the next store on that
    directory, in a loop of build / use / drop, was refused with EBUSY "another live SwapStore (pid <this
    process>)". A claim refused by this process now collects its garbage and looks again, as disk_offload's
    does."""
    directory = tmp_path / "s"
    was_enabled = gc.isenabled()
    gc.disable()  # (the collector running between two cycles by chance hid it)
    try:
        gc.collect()  # earlier tests' garbage holding descriptors goes now, not in the collects this test causes
        fds = open_fds()
        for _ in range(3):
            _use(directory)  # dropped: nothing refers to the store any more
        gc.collect()
        assert open_fds() == fds
    finally:
        if was_enabled:
            gc.enable()
    assert not os.path.exists(directory)  # the last store's files and directory went with it


def test_a_store_in_use_still_keeps_the_directory(tmp_path):
    """The collection above frees only garbage: a store still held (through its swapped tensor) keeps it."""
    held = _use(tmp_path / "s")
    with pytest.raises(OSError, match="another live SwapStore") as info:
        swapio.SwapStore(tmp_path / "s")
    assert info.value.errno == 16  # EBUSY
    assert torch.equal(held.swap_in().wait(TIMEOUT), torch.arange(1000.0))
    held.store.close()


@pytest.mark.usefixtures("ctrl_c_raises")
def test_bug_ctrl_c_while_close_lets_go_of_the_handle_finishes_it(tmp_path, monkeypatch):
    """BUG: close() marked the store closed first, so a Ctrl-C landing in it (here as it closes its handle) left
    the rest undone for good: the lock stayed held for the process's life (every later store on the directory:
    EBUSY), with its descriptor, the lock file and the directory; a second close() did nothing. Letting go of the
    handle, the lock and the directory now runs whole, and the Ctrl-C is raised after."""
    directory = tmp_path / "s"
    fds = open_fds()
    store = swapio.SwapStore(directory)
    store.swap_out(torch.ones(100), name="w").wait(TIMEOUT)
    ctrl_c_on_call(monkeypatch, store.handle, "close", 0)
    with pytest.raises(KeyboardInterrupt):
        store.close()
    assert store.handle.closed and not os.path.exists(directory) and open_fds() == fds
    _assert_reusable(directory)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_bug_a_second_close_finishes_one_a_ctrl_c_cut_short(tmp_path, monkeypatch):
    """BUG (as above): a Ctrl-C while close() waited for a pending write ended it there; close() again did nothing,
    so the other swap files, the lock and the directory stayed. The next close() now finishes the work."""
    directory = tmp_path / "s"
    fds = open_fds()
    store = swapio.SwapStore(directory)
    for name in ("a", "b"):
        store.swap_out(torch.ones(100), name=name, release=False)
    ctrl_c_on_call(monkeypatch, swapio.SwappedTensor, "wait", 0)
    with pytest.raises(KeyboardInterrupt):
        store.close()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="closed"):
        store.swap_out(torch.ones(1))  # closing: no new work
    store.close()
    assert not os.path.exists(directory) and open_fds() == fds
    _assert_reusable(directory)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_bug_ctrl_c_as_the_directory_is_claimed_leaves_it_free(tmp_path, monkeypatch):
    """BUG: a Ctrl-C landing right after the store claimed its directory, before the store kept the claim, left
    the claim held by swapio's registry of live owners for the process's life (its lock, descriptor and lock
    file: every later store on the directory EBUSY). The claim is now the store's before a Ctrl-C is raised."""
    directory = tmp_path / "s"
    fds = open_fds()
    ctrl_c_on_call(monkeypatch, _swapdir, "claim", 0, after=True)
    with pytest.raises(KeyboardInterrupt):
        swapio.SwapStore(directory)
    monkeypatch.undo()
    gc.collect()
    assert not os.path.exists(directory) and open_fds() == fds
    _assert_reusable(directory)


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("user", ["optimizer", "activations"])
def test_bug_ctrl_c_as_a_private_swap_directory_is_made_removes_it(tmp_path, monkeypatch, user):
    """BUG: a Ctrl-C landing as an nvme optimizer or activation offload got its private swap directory, before it
    kept it, left that directory, its lock and descriptor for the process's life (the registry of live owners
    held it). An owner dropped before anyone kept it now removes what it claimed."""
    fds = open_fds()
    ctrl_c_on_call(monkeypatch, _swapdir, "private_directory", 0, after=True)
    with pytest.raises(KeyboardInterrupt):
        if user == "optimizer":
            swapio.optim.OffloadAdamW(torch.nn.Linear(4, 4).parameters(), offload="nvme", swap_dir=tmp_path)
        else:
            swapio.offload.offload_activations(to="nvme", swap_dir=tmp_path)
    gc.collect()
    assert os.listdir(tmp_path) == [] and open_fds() == fds


def test_sigterm_registry_does_not_keep_a_released_or_dropped_owner(tmp_path):
    """The SIGTERM handler's registry of live owners holds them weakly: their users keep them."""
    before = len(_swapdir._live)
    store = swapio.SwapStore(tmp_path / "s")
    assert len(_swapdir._live) == before + 1
    store.close()
    del store
    gc.collect()
    assert len(_swapdir._live) == before
