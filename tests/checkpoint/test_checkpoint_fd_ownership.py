"""Every file descriptor a save or load opens has one owner and is closed exactly once, wherever an exception (a
signal handler's) lands: before each bytecode of the code that opens, hands over and closes them in turn
(helpers/fd_audit.py), then the next save and load work and nothing is left open.

Tests named test_bug_* each caught a bug (their docstrings say which).
"""
import gc
import importlib
import os
import threading

import pytest
import torch

import swapio.checkpoint as ckpt
from swapio import _C

from helpers.fd_audit import FdAudit, code_objects, sweep

commit = importlib.import_module("swapio.safetensors.commit")
buffers = importlib.import_module("swapio.safetensors.buffers")
file_writer = importlib.import_module("swapio.safetensors.file_writer")
durable = importlib.import_module("swapio.core._durable")
owned_fd = importlib.import_module("swapio.core._owned_fd")


def _fd_code():
    """The code that opens, hands over and closes the descriptors of a checkpoint's files, and Thread.start (which
    hands the replaced file's descriptor to the helper thread that closes it). Not OwnedFd.__del__: an exception
    there is printed and dropped by Python, its descriptor left open (a leak, never a second close)."""
    return code_objects(commit, durable, file_writer, buffers, owned_fd, threading.Thread.start,
                        exclude=("OwnedFd.__del__",))


def _no_temporary_files(directory):
    return [n for n in os.listdir(directory) if commit.TAG in n]


def test_bug_a_save_interrupted_at_any_point_closes_each_descriptor_exactly_once(tmp_path):
    """BUG: commit() hands the replaced file's descriptor to a helper thread (which closes it, freeing the file's
    blocks off the caller's time); an interruption inside Thread.start() after the thread started, but before it
    recorded its ident, made the caller close it too (`if t.ident is None: os.close(fd)`): two closes, the second
    one EBADF or, once another open reused the number, someone else's file (seen in the SIGALRM storm as a load's
    read failing with EBADF and EBADF in swapio-checkpoint-unlink). Also: an interruption before the thread
    started left it in the list wait_for_unlinks joins (RuntimeError "cannot join thread before it is started"),
    and one between an os.open and the statement recording its descriptor, or in a `finally` before its os.close,
    left the descriptor open (the temporary file's, with its lock: never reclaimed while the process lives)."""
    state = {"w": torch.randn(1000), "b": torch.randn(3)}
    path = tmp_path / "a.safetensors"
    ckpt.save(state, path)  # every save below replaces a file: its descriptor goes to the helper thread
    errors = []

    def settle():
        try:
            commit.wait_for_unlinks()
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            errors.append(repr(exc))
    with FdAudit() as audit:
        runs = sweep(lambda: ckpt.save(state, path), _fd_code(), after_each=settle)
        gc.collect()
        leaks = audit.leaks()
    assert runs > 100 and audit.opened > runs
    assert (audit.problems, sorted(set(errors)), leaks) == ([], [], [])
    assert _no_temporary_files(tmp_path) == []
    got = ckpt.load(path)
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.slow
def test_pin_a_load_interrupted_at_any_point_leaves_loads_working(tmp_path):
    """PIN: load interrupted at each point of its reads (the header's file, the kept handle, its requests and
    their futures): no descriptor closed twice or left open, the next load reads the file's bytes, and after
    release_buffers no handle memory is held."""
    state = {"w": torch.randn(1 << 18), "b": torch.randn(3)}  # "w" (1 MiB): its own direct read
    path = tmp_path / "a.safetensors"
    ckpt.save(state, path)
    reading = [importlib.import_module(f"swapio.{m}") for m in ("checkpoint.load", "safetensors.reader",
                                                                 "safetensors.files", "core.handle", "core.futures")]
    with FdAudit() as audit:
        runs = sweep(lambda: ckpt.load(path), code_objects(buffers, *reading))
        gc.collect()
        leaks = audit.leaks()
    assert runs > 100
    assert audit.problems == [] and leaks == []
    got = ckpt.load(path)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    del got
    ckpt.release_buffers()
    gc.collect()
    assert _C.held_bytes() == {"pinned": 0, "bounce": 0}


def test_pin_an_owned_descriptor_closed_by_many_threads_at_once_is_closed_once(tmp_path):
    """PIN: OwnedFd.close from 8 threads released together (and again, and by its finalizer): one os.close."""
    path = tmp_path / "f"
    path.write_bytes(b"x")
    with FdAudit() as audit:
        for _ in range(20):
            owned = owned_fd.OwnedFd.open(path, os.O_RDONLY | os.O_CLOEXEC)
            assert os.pread(owned.fileno(), 1, 0) == b"x"
            start = threading.Barrier(8)

            def close_it():
                start.wait()
                owned.close()
            threads = [threading.Thread(target=close_it) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert owned.closed
            owned.close()
            del owned
        leaks = audit.leaks()
    assert audit.opened == 20 and audit.problems == [] and leaks == []
