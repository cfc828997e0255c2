"""swapio.offload's files under interruptions at every point where a signal handler could run in the code that
opens, locks and closes them (save_checkpoint's exports, offload_dir's reservation and its owner's lock file):
each descriptor closed exactly once, none left open, and the next call works (helpers/fd_audit.py)."""
import gc
import importlib
import os
import threading

import pytest
import torch

from helpers.fd_audit import FdAudit, code_objects, sweep, settle_unlinks
from swapio.offload import disk_offload, remove_offload, save_checkpoint

commit = importlib.import_module("swapio.safetensors.commit")
safetensors_torch = importlib.import_module("safetensors.torch")

COMMON = ("swapio.safetensors.commit", "swapio.core._durable", "swapio.core._owned_fd")


def _fd_code(*names):
    modules = [importlib.import_module(m) for m in names + COMMON]
    return code_objects(*modules, threading.Thread.start, exclude=("OwnedFd.__del__",))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


@pytest.mark.slow
def test_bug_an_export_interrupted_anywhere_closes_each_descriptor_once(tmp_path):
    """BUG (as in checkpoint/test_checkpoint_fd_ownership.py: the replaced file closed twice by an interrupted
    commit, here of an export's shards and index): save_checkpoint to a file and to a sharded directory."""
    model = _model()
    single, sharded = tmp_path / "m.safetensors", tmp_path / "sharded"
    save_checkpoint(model, single)
    save_checkpoint(model, sharded, max_shard_size=1024)
    errors = []
    with FdAudit() as audit:
        runs = sweep(lambda: save_checkpoint(model, single), _fd_code("swapio.offload.export"),
                     after_each=settle_unlinks(errors))
        runs += sweep(lambda: save_checkpoint(model, sharded, max_shard_size=1024),
                      _fd_code("swapio.offload.export"), after_each=settle_unlinks(errors))
        gc.collect()
        leaks = audit.leaks()
    assert runs > 100
    assert (audit.problems, sorted(set(errors)), leaks) == ([], [], [])
    expected = model.state_dict()
    for path in (single, sharded):
        index = save_checkpoint(model, path, max_shard_size=1024 if path == sharded else None)
        got = {}
        for name in os.listdir(os.path.dirname(index) if path == sharded else tmp_path):
            if name.endswith(".safetensors") and (path == sharded or name == single.name):
                got.update(safetensors_torch.load_file(os.path.join(os.path.dirname(index), name)))
        assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
        assert [n for n in os.listdir(os.path.dirname(index)) if commit.TAG in n] == []


@pytest.mark.slow
def test_bug_disk_offload_interrupted_anywhere_leaves_the_offload_dir_usable(tmp_path):
    """BUG: disk_offload into an offload_dir (the owner's lock file, the reserved data file, the index's commit)
    and remove_offload, interrupted at each point. An interruption between the lock file's os.open and the
    statement recording it (or in a `finally` before its os.close) left the descriptor, and its flock, open for
    the life of the process: every later disk_offload into that directory was refused with EBUSY ("a live
    offloaded model ... uses this offload_dir"). Afterwards a model offloaded there computes what the resident
    one does."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _model()(x)
    od = tmp_path / "od"

    def offload_and_back():
        remove_offload(disk_offload(_model(), od))

    with FdAudit() as audit:
        runs = sweep(offload_and_back, _fd_code("swapio.offload.offload_dir", "swapio.offload.dir_owner",
                                                "swapio.core._swapdir"))
        gc.collect()
        leaks = audit.leaks()
    assert runs > 50
    assert (audit.problems, leaks) == ([], [])
    model = disk_offload(_model(), od)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    remove_offload(model)
