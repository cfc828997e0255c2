"""Ctrl-C while the interpreter exits and an in_backward=True optimizer still updates on its worker thread (the
program's last backward returned; a user presses Ctrl-C because the program "hangs" at its end): Python stopped
waiting for the worker and finalized under it, printing a KeyboardInterrupt traceback and at times aborting
("terminate called without an active exception"). The exit now waits for the updates in flight (a few batches at
most), says so, and ends normally with the swap directory removed."""
import json

from conftest import run_python

SCENARIO = r"""
import os, signal, sys, threading, time, torch
import swapio.optim.offloaded as offloaded
from swapio.offload import cpu_offload
from swapio.optim import OffloadAdamW
swap_dir = sys.argv[1]
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
cpu_offload(net)
opt = OffloadAdamW(net.parameters(), lr=1e-2, offload="nvme", swap_dir=swap_dir, in_backward=True)
exiting, real = threading.Event(), offloaded.OffloadedParams.update

def update_after_ctrl_c(self, *args, **kwargs):  # the worker updates on while the main thread, exiting, waits
    exiting.wait()
    time.sleep(0.5)  # the main thread is in the interpreter's shutdown now, joining this thread
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return real(self, *args, **kwargs)

offloaded.OffloadedParams.update = update_after_ctrl_c
net(torch.randn(4, 32)).square().mean().backward()
exiting.set()
"""


def test_ctrl_c_at_exit_waits_for_the_updates_in_flight_and_ends_cleanly(tmp_path):
    result = run_python(SCENARIO, tmp_path)
    assert "terminate called" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert "in_backward" in result.stderr  # said, not silent
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == "[]"  # the swap directory went as usual
