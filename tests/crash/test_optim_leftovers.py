"""Whatever a killed swapio optimizer leaves in a directory, the next swapio user of that directory reclaims,
never touching what a live process is using: the temporary file of a save killed before its commit
(checkpoint directory), the private directory of an optimizer that ran out of file descriptors (swap_dir)."""
import errno
import json
import os
import signal
import time

import pytest

from swapio.safetensors import commit
from swapio.optim import checkpoint
from helpers.fork import forkserver, run_child  # noqa: F401
from helpers.resume import make_opt, make_params, train

pytestmark = pytest.mark.crash

TMP = f".{checkpoint.FILE}{commit.TAG}"  # + <hex>.tmp: the checkpoint being written


def _killed_saver(forkserver, ckpt, swap_dir, sig):
    """A process that saved a checkpoint, then signals itself (SIGKILL, SIGSTOP) inside its next save, once the
    temporary file is written, before its commit. Returns it (stopped, or ended)."""
    from helpers import matrix_child

    proc = forkserver.Process(target=matrix_child.child, daemon=True,
                              args=("cpu", str(swap_dir), str(ckpt), str(ckpt) + ".dump", "save", "file_fsync", 0, sig))
    proc.start()
    deadline = time.monotonic() + 60
    while proc.is_alive():
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] == "T":
                    break  # stopped
        except (FileNotFoundError, ProcessLookupError):
            break  # it ended (and the fork server, its parent, reaped it) since is_alive() looked
        assert time.monotonic() < deadline, "the saver never stopped"
        time.sleep(0.01)
    return proc


def test_save_reclaims_what_killed_saves_left(forkserver, tmp_path):
    ckpt = tmp_path / "ckpt"
    for _ in range(2):  # two savers killed before their commit
        proc = _killed_saver(forkserver, ckpt, tmp_path, signal.SIGKILL)
        proc.join(60)
        assert proc.exitcode == -signal.SIGKILL
    left = sorted(os.listdir(ckpt))
    # the second saver's first save removed what the first one left; the second's own leftovers remain
    saves = {n[len(TMP):].split(".")[0] for n in left if n.startswith(TMP)}  # its file, and the link to the old
    assert len(saves) == 1, left
    params = make_params()
    opt = make_opt("adamw", params, "cpu", None)
    train(opt, params, 1, 2)
    opt.save(ckpt)
    assert os.listdir(ckpt) == [checkpoint.FILE]
    opt.load(ckpt)
    opt.close()


def test_save_never_touches_the_files_of_a_live_save(forkserver, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _killed_saver(forkserver, ckpt, tmp_path, signal.SIGSTOP)  # stopped in the middle of its save
    try:
        theirs = sorted(os.listdir(ckpt))
        assert any(n.startswith(TMP) for n in theirs), theirs
        params = make_params()
        opt = make_opt("adamw", params, "cpu", None)
        train(opt, params, 1, 1)
        with pytest.raises(OSError) as info:
            opt.save(ckpt)
        assert info.value.errno == errno.EBUSY
        assert sorted(os.listdir(ckpt)) == theirs
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    proc.join(60)
    assert proc.exitcode == 0
    opt.save(ckpt)  # now it may: the other save is over
    assert os.listdir(ckpt) == [checkpoint.FILE]
    opt.close()


def test_nvme_optimizers_out_of_descriptors_leave_nothing_the_next_one_keeps(forkserver, tmp_path):
    from helpers import leftover_children

    swap_dir, result = tmp_path / "swap", tmp_path / "result.json"
    swap_dir.mkdir()
    assert run_child(forkserver, leftover_children.out_of_descriptors, str(swap_dir), str(result)) == 0
    assert json.loads(result.read_text())["failed"] >= 6  # setups did fail, at several points
    assert os.listdir(swap_dir) == []
