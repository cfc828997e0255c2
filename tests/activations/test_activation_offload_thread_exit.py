"""A `with` block of offload_activations ended in a thread that did not enter it. Torch's saved-tensor hooks are
per thread: the exit found nothing of its thread's to take off and returned quietly, leaving the hooks pushed in
the entering thread, whose later saves kept going to a forward that never ended (its swap file stayed until
close()). It now raises, and the block can still be ended in its own thread."""
import threading

import pytest
import torch

from helpers.activations import hooks_installed, swap_files
from swapio.offload import offload_activations


def test_a_block_ended_in_another_thread_raises_and_can_still_be_ended_in_its_own(tmp_path):
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0)
    entered, may_leave, left, outcome = threading.Event(), threading.Event(), threading.Event(), {}
    x = torch.randn(256, 256, requires_grad=True)

    def forward_in_a_thread():
        act.__enter__()
        outcome["loss"] = (x * 2).sin().sum()
        entered.set()
        may_leave.wait(30)
        act.__exit__(None, None, None)
        outcome["hooks_after"] = hooks_installed()
        left.set()
    thread = threading.Thread(target=forward_in_a_thread, daemon=True)
    thread.start()
    assert entered.wait(30)
    with pytest.raises(RuntimeError, match="same thread"):
        act.__exit__(None, None, None)
    may_leave.set()
    assert left.wait(30)
    thread.join(30)
    assert outcome["hooks_after"] is False
    outcome.pop("loss").backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()
