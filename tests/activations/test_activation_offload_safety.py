"""Activation offload when things go wrong: Ctrl-C in forward or backward, a killed process, a failing disk; and
the memory bound of to="nvme" on the CPU, measured as the process's peak RSS in a child."""
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers.autograd import OnBackward
from helpers.activations import assert_same_grads, batch, grads_of, hooks_installed, make_stack, swap_files
from helpers.rss_child import PRELUDE
from swapio.core import handle as handle_module
from swapio.offload import offload_activations

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt at the next bytecode


def interrupt_inside(module):
    own = module.forward

    def forward(*args, **kwargs):
        out = own(*args, **kwargs)
        ctrl_c()
        return out
    module.forward = forward


def assert_clean(act):
    assert not hooks_installed()
    assert swap_files(act.directory) == []
    stats = act.stats()
    assert stats["pinned_bytes"] == 0 and stats["live_sessions"] == 0


def test_ctrl_c_in_forward_leaves_no_hooks_files_or_memory_and_the_next_step_works(tmp_path):
    model, x = make_stack(), batch()
    want = grads_of(model, x)
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=1 << 14)
    interrupt_inside(model.blocks[1])  # a block's saved tensors are on their way out when Ctrl-C arrives
    with pytest.raises(KeyboardInterrupt):
        grads_of(model, x, act)
    assert_clean(act)  # at once, not when the partial graph is collected
    del model.blocks[1].forward
    assert_same_grads(grads_of(model, x, act), want)
    assert_clean(act)


@pytest.mark.parametrize("where", ["in-a-node", "while-reading"])
def test_ctrl_c_in_backward_leaves_no_hooks_files_or_memory(tmp_path, monkeypatch, where):
    model, x = make_stack(), batch()
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=0)
    xx = x.clone().requires_grad_(True)
    with act:
        h = model.blocks[0](xx)
        h = OnBackward.apply(h, ctrl_c) if where == "in-a-node" else h
        loss = model.blocks[2](model.blocks[1](h)).sum()
    if where == "while-reading":
        real = handle_module.AioHandle.pread
        calls = []

        def pread(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)
        monkeypatch.setattr(handle_module.AioHandle, "pread", pread)
    with pytest.raises(KeyboardInterrupt):
        loss.backward()
    if where == "while-reading":
        assert_clean(act)  # discarded at once: the graph cannot run backward again
        with pytest.raises(RuntimeError, match="discarded|second time"):
            loss.backward()
    del loss, h
    gc.collect()
    assert_clean(act)
    monkeypatch.undo()
    assert grads_of(model, x, act)  # and the next step works
    assert_clean(act)


def test_a_failing_disk_fails_the_forward_with_its_oserror_and_cleans_up(tmp_path, monkeypatch):
    model, x = make_stack(), batch()
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=0)
    real = handle_module.AioHandle.pwrite

    def pwrite(self, tensor, path, *args, **kwargs):
        import errno
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(handle_module.AioHandle, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space"):
        grads_of(model, x, act)
    assert_clean(act)
    monkeypatch.setattr(handle_module.AioHandle, "pwrite", real)
    assert_same_grads(grads_of(model, x, act), grads_of(model, x))


KILLED = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from helpers.activations import make_stack, batch
from swapio.offload import offload_activations
model = make_stack()
act = offload_activations(to="nvme", swap_dir={swap!r}, min_bytes=0, staging_bytes=0)
with act:
    loss = model(batch().requires_grad_(True)).sum()
print(act.directory, flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.crash
def test_swap_files_of_a_killed_process_are_reclaimed_by_the_next_one(tmp_path):
    code = KILLED.format(tests=os.path.join(REPO, "tests"), swap=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == -9, proc.stderr
    left = proc.stdout.split()[0]
    assert os.path.isdir(left) and swap_files(left)  # SIGKILL: nothing could clean up
    with pytest.warns(UserWarning, match="died"):
        act = offload_activations(to="nvme", swap_dir=tmp_path)
    assert not os.path.exists(left)
    act.close()
    assert os.listdir(tmp_path) == []


MEMORY = PRELUDE + """
import json, sys, torch
from swapio.offload import offload_activations
torch.set_num_threads(1)
WIDTH, ROWS, DEPTH = 512, 2048, 12   # each layer saves its input and its pre-activation: 2 x 4 MiB
mode, swap_dir, staging = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
def forward(x):
    for layer in layers:
        x = torch.nn.functional.gelu(layer(x))
    return x.sum()
x = torch.randn(ROWS, WIDTH, requires_grad=True)
act = offload_activations(to="nvme", swap_dir=swap_dir, model=layers, min_bytes=0, staging_bytes=staging)
forward(x).backward()  # warm up: allocator, threads, the swap file
layers.zero_grad(); x.grad = None
reset_peak(); base = status("VmRSS")
if mode == "nvme":
    with act:
        loss = forward(x)
else:
    loss = forward(x)
loss.backward()
grads = sum(p.grad.nbytes for p in layers.parameters())
print(json.dumps({"peak": status("VmHWM") - base, "layer": 2 * ROWS * WIDTH * 4, "param_grads": grads}))
"""


def peak_activation_rss(mode, swap_dir, staging):
    env = {**os.environ, "PYTHONPATH": REPO, "MALLOC_MMAP_THRESHOLD_": str(1 << 16), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MEMORY, mode, str(swap_dir), str(staging)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_of_activations_is_bounded_by_the_staging_ring_and_two_layers(tmp_path):
    """RSS that the forward + backward adds at its peak: with to="nvme", at most staging_bytes + two layers' saved
    tensors (read back ahead) + two layers of working tensors (the layer computing and the gradient flowing
    back) + the parameters' gradients; without offload, all twelve layers' saved tensors come on top."""
    staging = 8 << 20
    off = peak_activation_rss("nvme", tmp_path, staging)
    plain = peak_activation_rss("none", tmp_path, staging)
    layer = off["layer"]
    bound = staging + 2 * layer + 2 * layer + off["param_grads"]
    assert off["peak"] <= bound, f"peak {off['peak'] >> 20} MiB > bound {bound >> 20} MiB"
    assert plain["peak"] > bound  # the bound is below what the activations need without offload


class HeldWrite:
    """A write's future that reports itself unfinished until waited for (so it is still pending when close()
    runs); the first wait for it raises KeyboardInterrupt (Ctrl-C while close() waits)."""

    def __init__(self, future, interrupt):
        self.future, self.interrupt = future, interrupt

    def done(self):
        return False

    def exception(self, timeout=None):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return self.future.exception(timeout)

    def wait(self, timeout=None):
        return self.future.wait(timeout)


def test_ctrl_c_while_close_waits_for_writes_reaches_the_user_after_the_cleanup(tmp_path, monkeypatch):
    """close() waits for the writes in flight before it frees their memory: a Ctrl-C during that wait was
    swallowed (close returned as if nothing had happened). It is raised once everything is cleaned up."""
    model, x = make_stack(), batch()
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0)
    real, writes = handle_module.AioHandle.pwrite, []

    def pwrite(self, *args, **kwargs):
        writes.append(HeldWrite(real(self, *args, **kwargs), interrupt=False))
        return writes[-1]
    monkeypatch.setattr(handle_module.AioHandle, "pwrite", pwrite)
    with act:
        loss = model(x.clone().requires_grad_(True)).sum()
    assert len(writes) >= 2
    # the first close() waits for (the forward waited for the oldest ones while 32 were in flight)
    first = next(i for i, w in enumerate(writes) if not w.future.observed)
    assert first < len(writes) - 1
    writes[first].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        act.close()
    assert all(w.future.done() and w.future.observed for w in writes[first + 1:])  # the others still waited for
    assert_clean(act)
    with pytest.raises(RuntimeError, match="discarded|released"):
        loss.backward()


def own_fds_under(directory):
    """This process's open descriptors of files under directory (removed ones included)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.fspath(directory) + os.sep):
            out.append(target)
    return out


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_close_removes_the_swap_directory_is_raised_once_it_is_gone(tmp_path, monkeypatch):
    """A Ctrl-C landing while close() removes the swap directory (found by fuzzing: most of close's time is
    there) left the directory half removed and its lock file's descriptor open for the rest of the process; the
    clean-up runs once, so close() again did nothing. It is raised once the directory is gone."""
    import shutil

    model, x = make_stack(), batch()
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0)
    grads_of(model, x, act)
    directory = act.directory
    real, calls = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            ctrl_c()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        act.close()
    monkeypatch.undo()
    assert calls and not os.path.exists(directory)
    assert own_fds_under(tmp_path) == []
    assert os.listdir(tmp_path) == []
    act.close()  # idempotent


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_autograd_frees_the_saved_activations_leaves_the_session_ended(tmp_path, monkeypatch):
    """Autograd frees the saved tensors at the end of backward, in finalizers; the last one ends the session
    (waits for its writes, removes its file, frees its memory). A Ctrl-C landing there (found by fuzzing: the
    waits and the file's removal are where it lands) ended that work half done for good: the session, its file
    and its memory stayed until close(). Python drops an exception raised in a finalizer, so the Ctrl-C is held
    until the session has ended (and then dropped: docs/activations.md)."""
    from swapio.offload import activation_store

    model, x = make_stack(), batch()
    want = grads_of(model, x)
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=0)
    real, calls = activation_store.remove_soon, []

    def remove_soon(path):
        calls.append(path)
        ctrl_c()
        return real(path)

    monkeypatch.setattr(activation_store, "remove_soon", remove_soon)
    grads_of(model, x, act)
    monkeypatch.undo()
    assert calls
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    assert act.stats()["pinned_bytes"] == 0
    assert_same_grads(grads_of(model, x, act), want)
    act.close()


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_close_discards_a_forward_still_discards_the_others_and_the_directory(tmp_path, monkeypatch):
    """close() discards each forward still held, then removes the directory: a Ctrl-C in the first discard ended
    close() there, the other forwards' files and memory and the directory kept. It is raised once all is done."""
    from swapio.offload.activation_store import Session

    model, x = make_stack(), batch()
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0)
    losses = []
    for _ in range(2):  # two forwards whose graphs are still held
        with act:
            losses.append(model(x.clone().requires_grad_(True)).sum())
    directory = act.directory
    assert act.stats()["live_sessions"] == 2
    real, calls = Session.abort, []

    def abort(self):
        calls.append(self)
        if len(calls) == 1:
            ctrl_c()
        return real(self)

    monkeypatch.setattr(Session, "abort", abort)
    with pytest.raises(KeyboardInterrupt):
        act.close()
    monkeypatch.undo()
    assert len(calls) == 2 and not os.path.exists(directory) and os.listdir(tmp_path) == []
    assert act.stats()["live_sessions"] == 0 and act.stats()["pinned_bytes"] == 0
    for loss in losses:
        with pytest.raises(RuntimeError, match="discarded|released"):
            loss.backward()
