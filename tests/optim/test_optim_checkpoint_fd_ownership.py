"""Optimizer checkpoints (opt.save / opt.load) interrupted at every point where a signal handler could run in the
code that opens, locks and closes their files: each descriptor closed exactly once, none left open, and the
checkpoint loads into a fresh optimizer as it was saved (helpers/fd_audit.py).

Tests named test_bug_* each caught a bug (their docstrings say which).
"""
import gc
import importlib
import os
import shutil
import threading

import pytest

from helpers.fd_audit import FdAudit, code_objects, sweep, settle_unlinks
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, make_opt, make_params, snapshot, train

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "optim-v3")
V3_SHAPES = [(300,), (17, 33), (513,)]


def _fd_code(*more):
    modules = [importlib.import_module(m) for m in ("swapio.core._dir_lock", "swapio.optim.checkpoint",
                                                    "swapio.optim.checkpoint.legacy", "swapio.safetensors.commit",
                                                    "swapio.core._durable", "swapio.core._owned_fd")]
    return code_objects(*modules, threading.Thread.start, exclude=("OwnedFd.__del__",))


@pytest.mark.slow
def test_bug_optimizer_save_and_load_interrupted_anywhere_close_each_descriptor_once(tmp_path):
    """BUG (as in checkpoint/test_checkpoint_fd_ownership.py: the replaced file closed twice): save (the
    directory's flock, the file's commit, the replaced file's helper thread) and load (the shared flock)
    interrupted at each point."""
    params = make_params()
    opt = make_opt("adamw", params, "cpu", tmp_path)
    train(opt, params, 1, 2)
    ckpt = tmp_path / "ckpt"
    opt.save(ckpt)
    saved, errors = {**snapshot(opt, params), "params": []}, []  # (the parameters are the model's, not saved)
    with FdAudit() as audit:
        runs = sweep(lambda: opt.save(ckpt), _fd_code(), after_each=settle_unlinks(errors))
        runs += sweep(lambda: opt.load(ckpt), _fd_code())
        gc.collect()
        leaks = audit.leaks()
    assert runs > 100
    assert (audit.problems, sorted(set(errors)), leaks) == ([], [], [])
    other_params = make_params(seed=1)
    other = make_opt("adamw", other_params, "cpu", tmp_path)
    other.load(ckpt)
    assert_same({**snapshot(other, other_params), "params": []}, saved)
    opt.close()
    other.close()


def test_bug_a_version_3_load_interrupted_anywhere_closes_its_metadata_file_once(tmp_path):
    """BUG: read_legacy_meta opened the metadata with os.open, wrapped it with os.fdopen and closed the descriptor
    in `except BaseException`: an interruption right after fdopen returned (before `f` was assigned) freed the
    new file object, which closed the descriptor, and then closed it again (EBADF, or whatever file took the
    number). The file object now only borrows the descriptor (closefd=False); its OwnedFd closes it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "int8-state"), ckpt)
    params = make_params(shapes=V3_SHAPES)
    opt = make_opt("adamw", params, "cpu", tmp_path, "int8")
    with FdAudit() as audit:
        runs = sweep(lambda: opt.load(ckpt), _fd_code())
        gc.collect()
        leaks = audit.leaks()
    assert runs > 10
    assert (audit.problems, leaks) == ([], [])
    other_params = make_params(shapes=V3_SHAPES)
    other = make_opt("adamw", other_params, "cpu", tmp_path, "int8")
    other.load(ckpt)
    opt.load(ckpt)
    assert_same(snapshot(opt, params), snapshot(other, other_params))
    opt.close()
    other.close()
