"""fork() while another thread runs an offloaded model (DataLoader workers and multiprocessing pools fork like
this): a child that calls the model is told why it cannot, never hangs on a lock the other thread held; a child
that leaves the model alone exits normally, without waiting for the parent's reads or touching its files; and the
parent carries on as if nothing happened."""
import json
import threading

import pytest
import torch

from conftest import TIMEOUT, run_python
from helpers.fork import run_in_child
from swapio.offload import cpu_offload, disk_offload, remove_offload


class Waits(torch.nn.Linear):
    """A Linear whose forward, once started, waits for `release`: its weights are in place meanwhile."""

    def __init__(self, width):
        super().__init__(width, width)
        self.started, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.started.set()
        assert self.release.wait(TIMEOUT)
        return super().forward(x)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), Waits(32), torch.nn.Linear(32, 32)).requires_grad_(False)


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload"])
def test_a_child_forked_during_a_forward_is_refused_and_the_parent_carries_on(tmp_path, how):
    x = torch.randn(4, 32)
    net = model()
    net[1].release.set()
    with torch.no_grad():
        expected = net(x)
    net[1].release.clear()
    cpu_offload(net) if how == "cpu_offload" else disk_offload(net, offload_dir=tmp_path / "w")
    out = {}
    running = threading.Thread(target=lambda: out.update(y=net(x)))
    with torch.no_grad():
        running.start()
        assert net[1].started.wait(TIMEOUT)

        def child():
            with pytest.raises(RuntimeError, match="fork"):  # not a hang on the held lock
                net(x)

        try:
            assert run_in_child(child) == 0
        finally:
            net[1].release.set()
            running.join(TIMEOUT)
    assert torch.equal(out["y"], expected)
    with torch.no_grad():
        assert torch.equal(net(x), expected)
    remove_offload(net)
    assert torch.equal(net(x), expected)


EXIT_SCENARIO = r"""
import json, os, sys, threading, time, torch
from swapio.offload import disk_offload, remove_offload
from swapio.offload.api import _offloaded
directory = sys.argv[1]
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]).requires_grad_(False)
x = torch.randn(4, 32)
with torch.no_grad():
    expected = net(x)
disk_offload(net, offload_dir=directory)
files = sorted(os.listdir(directory))
held, release = threading.Event(), threading.Event()

def reader():  # the fetcher's lock held, as by a forward waiting for its weights' reads (Fetcher.acquire)
    with _offloaded[net].fetcher.lock:
        held.set()
        release.wait()

threading.Thread(target=reader).start()
held.wait()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the interpreter's shutdown runs the model's finalizer in the child too
deadline, status = time.monotonic() + 20, None
while status is None and time.monotonic() < deadline:
    done, raw = os.waitpid(pid, os.WNOHANG)
    status = os.waitstatus_to_exitcode(raw) if done else None
    time.sleep(0.01)
if status is None:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
release.set()
kept = sorted(os.listdir(directory)) == files
with torch.no_grad():
    same = torch.equal(net(x), expected)
remove_offload(net)
print(json.dumps({"child": status, "same": same, "files_kept": kept}))
"""


def test_a_child_forked_during_a_read_exits_without_touching_the_parents_model(tmp_path):
    result = run_python(EXIT_SCENARIO, tmp_path / "w")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"child": 0, "same": True, "files_kept": True}
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


def test_a_disk_offloaded_model_called_in_a_child_says_what_to_do(tmp_path):
    x = torch.randn(4, 32)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).requires_grad_(False)
    with torch.no_grad():
        expected = net(x)
    disk_offload(net, offload_dir=tmp_path / "w")

    def child():  # its reads would go through the parent's I/O handle, whose threads the child does not have
        with pytest.raises(RuntimeError, match=r"disk_offload.*forked"):
            net(x)

    assert run_in_child(child) == 0
    with torch.no_grad():
        assert torch.equal(net(x), expected)
    remove_offload(net)
