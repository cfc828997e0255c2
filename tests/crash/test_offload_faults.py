"""The fault-and-interrupt matrix of the offload path: SIGINT and SIGKILL at points of disk_offload (with
remove_offload), of forwards, and of forward + backward with a trainable resident adapter, drawn from a seeded
generator; the child waits at its point until the signal comes (helpers/offload_crash_child.py). After a Ctrl-C the
process goes on and its model works as the resident one does; after a SIGKILL the next user of the directory
works and reclaims what the killed process left; either way nothing is left behind but the offload itself."""
import os
import random
import signal
import warnings

import pytest

from helpers.crash import wait_ready
from helpers.fork import forkserver  # noqa: F401
from helpers.offload_crash_child import POINTS, check_next_use, child

pytestmark = pytest.mark.crash

PHASES = ("offload", "forward", "backward")
SIGNALS = (signal.SIGINT, signal.SIGKILL)
ROUNDS = 3  # per phase and signal: 18 children in all


@pytest.mark.parametrize("phase", PHASES)
def test_interrupt_or_kill_at_random_points_then_the_next_use_works(tmp_path, forkserver, phase):
    rng = random.Random(f"offload-faults-{phase}")
    directory = str(tmp_path / "od")
    for i in range(ROUNDS * len(SIGNALS)):
        sig, target = SIGNALS[i % 2], rng.randint(1, POINTS[phase])
        ready, ready_in_child = forkserver.Pipe(duplex=False)
        result = forkserver.Value("b", 0, lock=False)
        proc = forkserver.Process(target=child, args=(phase, directory, target, ready_in_child, result), daemon=True)
        proc.start()
        ready_in_child.close()
        wait_ready(ready, proc, f"point {target} of {phase}")
        os.kill(proc.pid, sig)
        proc.join(60)
        assert proc.exitcode is not None, "the child hung after the signal"
        if sig == signal.SIGINT:
            assert result.value == 1, f"round {i}: after Ctrl-C the model did not work (see the child's traceback)"
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "removed ... left by an interrupted offload", when there was some
                check_next_use(directory, reuse=i % 4 == 1)
