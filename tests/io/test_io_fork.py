"""os.fork() with handles alive: the child's copies are dead (a clear error on use, never a hang), the child
exits cleanly, and handles (and the Adam pool) made in the child work."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import swapio
from conftest import REPO, TIMEOUT, queued_behind_big_read, random_bytes
from helpers.fork import run_in_child


def test_inherited_handle_is_dead_and_new_handles_work_in_the_child(tmp_path):
    data = random_bytes(1 << 20, 1)
    h = swapio.AioHandle(threads=2)
    assert h.pwrite(data, tmp_path / "parent.bin").wait(timeout=TIMEOUT) == data.nbytes

    expected = data.numpy().tobytes()

    def child():  # no parallel torch ops here: torch's OpenMP pool itself hangs in a forked child
        with pytest.raises(ValueError, match="fork"):
            h.pwrite(data, tmp_path / "from-inherited.bin")
        assert h.closed
        h.close()  # a no-op in the child, never a join of threads that are not there
        with swapio.AioHandle(threads=2) as mine:
            back = torch.empty_like(data)
            assert mine.pread(back, tmp_path / "parent.bin").wait(timeout=TIMEOUT) == data.nbytes
            assert back.numpy().tobytes() == expected

    assert run_in_child(child) == 0
    assert not (tmp_path / "from-inherited.bin").exists()
    assert h.pwrite(data, tmp_path / "after.bin").wait(timeout=TIMEOUT) == data.nbytes  # parent unaffected
    h.close()


def test_future_pending_at_fork_is_an_error_in_the_child(handle_factory, tmp_path):
    big, queued, _ = queued_behind_big_read(handle_factory, tmp_path)

    def child():
        for f in (big, queued):
            if not f.done():
                with pytest.raises(ValueError, match="fork"):
                    f.wait(timeout=TIMEOUT)

    assert run_in_child(child) == 0
    big.wait(timeout=TIMEOUT)
    queued.wait(timeout=TIMEOUT)


@pytest.mark.slow
def test_child_exits_cleanly_with_a_busy_inherited_handle(tmp_path):
    # A fresh interpreter, so the child runs Python's whole shutdown (finalizers that joined the workers
    # hung there) with a request of the parent's still queued.
    script = textwrap.dedent(f"""
        import os, sys, torch, swapio
        with open({str(tmp_path / "big.bin")!r}, "wb") as f:
            f.truncate(64 << 20)
        h = swapio.AioHandle(engine="psync", block_size=4096, queue_depth=1, direct=False)
        big = h.pread(torch.empty(64 << 20, dtype=torch.uint8), {str(tmp_path / "big.bin")!r})
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        big.wait()
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr


def test_adam_pool_works_in_the_child():
    n = 1 << 16
    p, g = torch.randn(n), torch.randn(n)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    ref = p.clone()
    swapio.ops.adam_step_(ref, g, torch.zeros(n), torch.zeros(n), threads=2, **kw)  # the pool is started
    mine, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    expected = ref.numpy().tobytes()

    def child():  # no torch ops here: torch's OpenMP pool itself hangs in a forked child
        swapio.ops.adam_step_(mine, g, m, v, threads=2, **kw)
        assert mine.numpy().tobytes() == expected

    assert run_in_child(child) == 0
