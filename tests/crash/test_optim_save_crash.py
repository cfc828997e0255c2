"""SIGKILL and SIGINT at random points of opt.save(): whatever the moment, the checkpoint directory then loads
as the previous or the new checkpoint, whole, never a mix (cpu and nvme modes)."""
import os
import random
import signal
import time
import warnings

import pytest

from swapio.optim import checkpoint
from helpers.fork import forkserver  # noqa: F401
from helpers.optim_save_crash_child import loaded_k, make_optimizer, saver, uniform_state
from helpers.crash import kill_while_saving

pytestmark = pytest.mark.crash

ITERATIONS = 48


def test_kill_at_random_points_of_save_leaves_a_whole_checkpoint(tmp_path, forkserver):
    ctx = forkserver  # savers fork from a server that imported optim_save_crash_child once
    ckpt, swap_dir = str(tmp_path / "ckpt"), str(tmp_path / "swap")
    os.mkdir(swap_dir)
    first = make_optimizer("cpu", None)
    first.load_state_dict(uniform_state(first, 0))
    first.save(ckpt)
    rng = random.Random(1234)
    last, in_save, killed_nvme, deadline = 0, 0, 0, time.monotonic() + 240
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(ITERATIONS):
            mode = ("cpu", "nvme")[i % 2]
            sig = (signal.SIGKILL, signal.SIGINT)[(i // 2) % 2]
            saved, was_saving = kill_while_saving(
                ctx, saver, lambda saved, saving: (mode, swap_dir, ckpt, last + 1, saved, saving), sig, deadline,
                rng.uniform(0, 0.08))
            in_save += was_saving
            killed_nvme += mode == "nvme" and sig == signal.SIGKILL
            done = saved.value
            k = loaded_k(ckpt, mode, swap_dir)  # in nvme mode this also reclaims a killed saver's directory
            assert k in (max(done, last), max(done, last) + 1), (i, k, done, last)  # the previous or the new one
            last = k
    print(f"{ITERATIONS} kills, {in_save} of them inside save()")  # the README's figure (pytest -s)
    assert in_save >= ITERATIONS // 4  # most kills landed inside save()
    assert checkpoint.FILE in os.listdir(ckpt)
    reclaimed = [w for w in caught if "died without cleaning up" in str(w.message)]
    # Every SIGKILLed saver's swap directory was found and removed (and any a SIGINTed one left: a
    # multiprocessing child ends with os._exit, so its finalizers may not run).
    assert len(reclaimed) >= killed_nvme
    assert os.listdir(swap_dir) == []
