"""Ctrl-C while the interpreter exits and async_save still writes (a user who presses Ctrl-C because the program
"hangs" at its end): Python stopped waiting for the writer threads and finalized under them, which aborted the
process ("terminate called without an active exception", SIGABRT) and left the temporary files. The save still
writing is abandoned instead: its temporary file removed, the previous file at its path intact, and the process
ends normally."""
import json

from conftest import run_python

SCENARIO = r"""
import os, signal, sys, threading, time, torch
import swapio
import swapio.safetensors.writer as writer
directory = sys.argv[1]
path = os.path.join(directory, "ckpt.safetensors")
swapio.checkpoint.save({"t": torch.zeros(1 << 16)}, path)  # the previous checkpoint
exiting, real = threading.Event(), writer.write

def write_after_ctrl_c(*args, **kwargs):  # the write runs on while the main thread, exiting, waits for it
    exiting.wait()
    time.sleep(0.5)  # the main thread is in the interpreter's shutdown now, joining this thread
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return real(*args, **kwargs)

writer.write = write_after_ctrl_c
swapio.checkpoint.async_save({"t": torch.ones(1 << 16)}, path)
exiting.set()
"""

CHECK = r"""
import json, os, sys, torch
import swapio
directory = sys.argv[1]
t = swapio.checkpoint.load(os.path.join(directory, "ckpt.safetensors"))["t"]
print(json.dumps({"files": sorted(os.listdir(directory)), "previous": bool((t == 0).all())}))
"""


def test_ctrl_c_at_exit_abandons_the_save_in_flight_cleanly(tmp_path):
    result = run_python(SCENARIO, tmp_path)
    assert "terminate called" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert "abandon" in result.stderr  # said, not silent
    check = run_python(CHECK, tmp_path)  # (a run of its own: a save would reclaim stale temporary files first)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout) == {"files": ["ckpt.safetensors"], "previous": True}
