"""SIGINT and SIGKILL at several points of step() and save(), cpu and nvme: a new process then loads the
checkpoint directory and continues bit-identically to a run never interrupted, and nothing is left behind (the
checkpoint directory holds one checkpoint, swap_dir nothing once the new optimizer is closed).

Each parameter's count in the checkpoint says how far it got (a Ctrl-C inside step() leaves each one stepped or
untouched); the new process takes each parameter's value at that count from the model checkpoint a user would
keep beside the optimizer's (here: the reference run's values, checked against what the child held when it
could say), and gives the rest of the step only to the parameters that had not taken it."""
import os
import signal

import pytest
import torch

from swapio.optim import checkpoint
from helpers.fork import forkserver, run_child  # noqa: F401
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, make_opt, make_params, set_grads, snapshot, train

pytestmark = pytest.mark.crash

LAST = 5
POINTS = [("step", "kernel", 1), ("step", "kernel", 3), ("step", "swap_write", 1), ("save", "data_write", 1),
          ("save", "data_write", 5), ("save", "file_fsync", 0), ("save", "dir_fsync", 0)]
CASES = [(mode, *point, sig) for mode in ("cpu", "nvme") for point in POINTS for sig in ("SIGINT", "SIGKILL")
         if not (mode == "cpu" and point[1] == "swap_write")]


@pytest.fixture(scope="module")
def reference():
    """Parameters after steps 2 and 3, and the snapshot after step LAST, of a run never interrupted."""
    params = make_params()
    opt = make_opt("adamw", params, "cpu", None)
    at = {}
    for step in range(1, LAST + 1):
        train(opt, params, step, step)
        at[step] = [p.detach().clone() for p in params]
    return at, snapshot(opt, params)


@pytest.mark.parametrize("mode, phase, point, at, sig", CASES)
def test_signal_then_a_new_process_resumes_bit_identically(mode, phase, point, at, sig, reference, forkserver,
                                                           tmp_path):
    from helpers import matrix_child

    ckpt, swap_dir, dump = tmp_path / "ckpt", tmp_path / "swap", tmp_path / "params.pt"
    swap_dir.mkdir()
    code = run_child(forkserver, matrix_child.child, mode, str(swap_dir), str(ckpt), str(dump), phase, point, at,
                     getattr(signal, sig))
    assert code == (-signal.SIGKILL if sig == "SIGKILL" else 130), code
    values, final = reference
    counts = [int(st["step"]) for _, st in sorted(checkpoint.read_meta(ckpt)["state"].items())]
    assert set(counts) <= {2, 3}, counts
    if dump.exists():  # what the child's model held agrees with its optimizer's counts
        for i, t in enumerate(torch.load(dump, weights_only=True)):
            assert torch.equal(t, values[counts[i]][i]), i
    params = [values[c][i].clone().requires_grad_(True) for i, c in enumerate(counts)]
    opt = make_opt("adamw", params, mode, swap_dir)  # reclaims what a killed child left in swap_dir
    opt.load(ckpt)
    for step in range(3, LAST + 1):
        set_grads(params, step, only=[i for i, c in enumerate(counts) if c < step])
        opt.step()
    assert_same(snapshot(opt, params), final)
    opt.save(ckpt)  # reclaims what an interrupted save left in the checkpoint directory
    assert os.listdir(ckpt) == [checkpoint.FILE]
    opt.close()
    assert os.listdir(swap_dir) == []
