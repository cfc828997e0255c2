"""Whatever a killed swapio optimizer leaves in a directory, the next swapio user of that directory reclaims,
never touching what a live process is using: temporary files of a save killed while writing its metadata
(checkpoint directory), the private directory of an optimizer that ran out of file descriptors (swap_dir)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from swapio.optim import checkpoint
from conftest import REPO
from resume_helpers import make_opt, make_params, train

META_TMP = f".{checkpoint.META}."  # + <hex>.tmp: metadata being written

# A child that saves a checkpoint and stops itself (`stop`) or dies (`kill`) while writing the metadata.
SAVER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path[:0] = [{repo!r}, os.path.join({repo!r}, "tests")]
    from resume_helpers import make_opt, make_params, train
    params = make_params()
    opt = make_opt("adamw", params, "cpu", None)
    train(opt, params, 1, 1)
    real_save = torch.save
    def save_then_stop(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.flush()
        os.kill(os.getpid(), signal.SIGSTOP if sys.argv[2] == "stop" else signal.SIGKILL)
    torch.save = save_then_stop
    opt.save(sys.argv[1])
""")


def _saver(ckpt, how):
    proc = subprocess.Popen([sys.executable, "-c", SAVER.format(repo=REPO), str(ckpt), how])
    deadline = time.monotonic() + 60
    while not any(n.startswith(META_TMP) for n in os.listdir(ckpt) if os.path.isdir(ckpt)):
        assert proc.poll() is None or how == "kill" and os.listdir(ckpt), "the saver ended early"
        assert time.monotonic() < deadline, "the saver never reached its metadata"
        time.sleep(0.01)
    if how == "stop":
        while open(f"/proc/{proc.pid}/stat").read().split(") ")[1][0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    else:
        proc.wait(60)
    return proc


def test_save_reclaims_what_killed_saves_left(tmp_path):
    ckpt = tmp_path / "ckpt"
    params = make_params()
    opt = make_opt("adamw", params, "cpu", None)
    train(opt, params, 1, 2)
    opt.save(ckpt)
    for _ in range(2):  # two savers killed while writing the metadata
        os.makedirs(ckpt, exist_ok=True)
        _saver(ckpt, "kill")
    left = sorted(os.listdir(ckpt))
    assert sum(n.startswith(META_TMP) for n in left) == 2, left
    opt.save(ckpt)
    meta = checkpoint.read_meta(ckpt)
    assert sorted(os.listdir(ckpt)) == sorted([checkpoint.META, meta["data"]])
    opt.load(ckpt)
    opt.close()


def test_save_never_touches_the_files_of_a_live_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    os.mkdir(ckpt)
    proc = _saver(ckpt, "stop")  # stopped in the middle of its save
    try:
        theirs = sorted(os.listdir(ckpt))
        params = make_params()
        opt = make_opt("adamw", params, "cpu", None)
        train(opt, params, 1, 1)
        with pytest.raises(OSError) as info:
            opt.save(ckpt)
        assert info.value.errno == 16  # EBUSY
        assert sorted(os.listdir(ckpt)) == theirs
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(60) == 0
    opt.save(ckpt)  # now it may: the other save is over
    assert sorted(os.listdir(ckpt)) == sorted([checkpoint.META, checkpoint.read_meta(ckpt)["data"]])
    opt.close()


# A child that builds nvme optimizers with ever fewer file descriptors left, each failing (EMFILE) at another
# point of its setup, then one with enough, and prints what its swap_dir holds after that one is closed.
OUT_OF_DESCRIPTORS = textwrap.dedent("""
    import errno, json, os, resource, sys, warnings
    sys.path[:0] = [{repo!r}, os.path.join({repo!r}, "tests")]
    import torch
    import swapio.optim as so
    warnings.simplefilter("ignore")
    swap_dir = sys.argv[1]
    p = torch.zeros(5000, requires_grad=True)
    p.grad = torch.ones(5000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    failed, left = 0, []
    for engine in ("uring", "aio", "psync"):
        for extra in range(-3, 3):
            used = len(os.listdir("/proc/self/fd")) - 1
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + extra, hard))
            try:
                with so.OffloadAdamW([p], offload="nvme", swap_dir=swap_dir, engine=engine) as opt:
                    opt.step()
            except OSError as exc:
                assert exc.errno == errno.EMFILE, exc
                failed += 1
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            left += os.listdir(swap_dir)
    with so.OffloadAdamW([p], offload="nvme", swap_dir=swap_dir) as opt:
        opt.step()
    print(json.dumps({{"failed": failed, "left_on_the_way": len(left), "left": os.listdir(swap_dir)}}))
""")


def test_nvme_optimizers_out_of_descriptors_leave_nothing_the_next_one_keeps(tmp_path):
    r = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS.format(repo=REPO), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["failed"] >= 6  # setups did fail, at several points
    assert out["left"] == []
