"""SIGKILL and Ctrl-C (SIGINT) at random points of save() and async_save(): whatever the moment, the file at the
checkpoint's path then loads as the previous or the new checkpoint, whole, never a mix; what a killed save left
is removed by the next save into the directory, but never the temporary file of a save still running."""
import pytest
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import torch

import swapio
from helpers.checkpoint_crash_child import loaded_k, saver, uniform_state
from helpers.checkpoint import leftovers
from helpers.crash import kill_while_saving
from helpers.fork import forkserver  # noqa: F401
from conftest import REPO
from swapio.safetensors.commit import PendingFile, reclaim

pytestmark = pytest.mark.crash

ITERATIONS = 32


def test_kill_at_random_points_of_save_leaves_a_whole_checkpoint(tmp_path, forkserver):
    ctx = forkserver  # savers fork from a server that imported checkpoint_crash_child once
    ckpt = str(tmp_path / "c.safetensors")
    swapio.checkpoint.save(uniform_state(0), ckpt)
    rng = random.Random(20)
    last, in_save, debris_seen, deadline = 0, 0, 0, time.monotonic() + 120
    for i in range(ITERATIONS):
        asynchronous = bool(i % 2)
        sig = (signal.SIGKILL, signal.SIGINT)[(i // 2) % 2]
        saved, was_saving = kill_while_saving(
            ctx, saver, lambda saved, saving: (ckpt, last + 1, saved, saving, asynchronous), sig, deadline,
            rng.uniform(0, 0.05))
        in_save += was_saving
        debris_seen += bool(leftovers(tmp_path))
        k = loaded_k(ckpt)
        assert k in (max(saved.value, last), max(saved.value, last) + 1), (i, k, saved.value, last)
        last = k
    print(f"{ITERATIONS} kills, {in_save} inside a save, {debris_seen} left a temporary file")
    assert in_save >= ITERATIONS // 4
    assert debris_seen >= 1  # some kill did land mid-write, so the reclaiming below is tested
    swapio.checkpoint.save(uniform_state(last + 1), ckpt)  # the next save removes what the killed ones left
    assert leftovers(tmp_path) == []
    assert loaded_k(ckpt) == last + 1


def test_the_temporary_file_of_a_live_save_is_never_reclaimed(tmp_path):
    live = PendingFile(tmp_path / "a.safetensors")  # holds its lock, as a save in progress does
    try:
        swapio.checkpoint.save({"x": torch.ones(3)}, tmp_path / "b.safetensors")
        assert reclaim(str(tmp_path)) == []
        assert os.path.exists(live.path)
    finally:
        live.abort()
    assert leftovers(tmp_path) == []
    # a file whose owner is gone (its lock free) is removed
    dead = PendingFile(tmp_path / "a.safetensors")
    dead.close()  # as if killed: the file stays, the lock is gone
    assert os.path.exists(dead.path)
    swapio.checkpoint.save({"x": torch.ones(3)}, tmp_path / "b.safetensors")
    assert not os.path.exists(dead.path)


def test_the_replaced_file_is_freed_after_the_commit_and_reclaimed_if_the_process_died(tmp_path):
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save({"x": torch.ones(1000)}, path)
    old_inode = path.stat().st_ino
    swapio.checkpoint.save({"x": torch.zeros(1000)}, path)  # replaces it; its blocks are freed on a helper thread
    assert path.stat().st_ino != old_inode
    assert leftovers(tmp_path) == []
    # as if killed between the commit and the unlink: a reclaimable name of the replaced file stays behind
    os.link(path, tmp_path / ".c.safetensors.swapio-ckpt-0123456789abcdef.old.tmp")
    swapio.checkpoint.save({"x": torch.full((1000,), 2.0)}, tmp_path / "other.safetensors")
    assert leftovers(tmp_path) == []
    assert torch.equal(swapio.checkpoint.load(path)["x"], torch.zeros(1000))


def test_a_save_killed_right_after_its_rename_leaves_no_name_behind(tmp_path):
    """The file a save replaces is freed off the save's path (a helper thread), yet a process killed before that
    helper ran leaves nothing in the directory, and a finished save leaves no second name of the replaced file
    even before its helper ran."""
    code = textwrap.dedent("""
        import os, signal, sys, torch, swapio
        from swapio.core import _durable
        real = _durable.publish
        def publish_then_die(tmp, final):
            replacing = os.path.exists(final)
            real(tmp, final)
            if replacing and os.path.basename(final) == "killed.safetensors":
                os.kill(os.getpid(), signal.SIGKILL)  # the new file is in place, the helper has not run
        _durable.publish = publish_then_die
        for name in ("kept.safetensors", "killed.safetensors"):
            path = os.path.join(sys.argv[1], name)
            swapio.checkpoint.save({"x": torch.zeros(1000)}, path)
            swapio.checkpoint.save({"x": torch.ones(1000)}, path)
            print(sorted(os.listdir(sys.argv[1])), flush=True)  # at once, not after the helper
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["['kept.safetensors']"]
    assert sorted(os.listdir(tmp_path)) == ["kept.safetensors", "killed.safetensors"]
    for name in ("kept.safetensors", "killed.safetensors"):
        assert torch.equal(swapio.checkpoint.load(tmp_path / name)["x"], torch.ones(1000))
