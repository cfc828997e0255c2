"""The activation offload's swap files under interruptions at every point where a signal handler could run in the
code that opens and closes their descriptors (the reservation of a file's blocks, and remove_soon, which hands the
last descriptor of a removed file to a thread): each descriptor closed exactly once, none left open, no file left
in the swap directory, and the next forward + backward equals the resident model's (helpers/fd_audit.py)."""
import gc
import importlib
import os
import tempfile
import threading

import pytest
import torch

from helpers.activations import assert_same_grads, batch, grads_of, make_stack
from helpers.fd_audit import FdAudit, code_objects, sweep
from helpers.isolated import run_isolated
from swapio.offload import offload_activations

store = importlib.import_module("swapio.offload.activation_store")
owned_fd = importlib.import_module("swapio.core._owned_fd")


def _wait_for_freeing_threads():
    """Joins the threads that close removed files. A start() interrupted before the thread was created leaves it
    listed for good, never started (the descriptor was closed by remove_soon then); one interrupted after says it
    started a moment later."""
    for t in threading.enumerate():
        if t.name == "swapio-free-activations" and t not in _never_started:
            if t._started.wait(5):
                t.join(30)
            else:
                _never_started.add(t)


_never_started: set = set()


@pytest.mark.slow
def test_bug_a_swap_file_interrupted_at_its_open_or_removal_leaks_no_descriptor(tmp_path):
    """BUG: `fd = os.open(...)` in the reservation of a session's file and in remove_soon: an interruption right
    after os.open returned (before the assignment), or before the `try` that closes it, left the descriptor open,
    with the removed file's blocks, for the life of the process. (In a child: helpers/isolated.py.)"""
    run_isolated(__file__, "sweep_the_swap_files_descriptors", str(tmp_path))


def sweep_the_swap_files_descriptors(directory):
    codes = code_objects(store.Session._reserve, store.remove_soon, owned_fd.OwnedFd, threading.Thread.start,
                         exclude=("OwnedFd.__del__",))
    model, x = make_stack(depth=1), batch()
    want = grads_of(model, x)
    swap_dir = tempfile.mkdtemp(dir=directory)  # (a fresh one for a second run)

    def step():
        with offload_activations(to="nvme", swap_dir=swap_dir, min_bytes=0) as act:
            grads_of(model, x, act)

    with FdAudit() as audit:
        runs = sweep(step, codes, after_each=_wait_for_freeing_threads)
        gc.collect()
        _wait_for_freeing_threads()
        leaks = audit.leaks()
    assert runs > 20
    assert (audit.problems, leaks) == ([], [])
    assert os.listdir(swap_dir) == []  # each private directory went with its close()
    with offload_activations(to="nvme", swap_dir=swap_dir, min_bytes=0) as act:
        assert_same_grads(grads_of(model, x, act), want)
