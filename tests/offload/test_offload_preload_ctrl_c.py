"""A Ctrl-C landing right after a preloaded module (preload_module_classes) took one of its submodules' locks,
before it listed the lock to give back: the lock stayed held by the interrupted thread for good, and every
forward of the model from another thread (a server's second request) waited forever. The Ctrl-C is now raised
once the lock is listed, and the interrupted call gives it back."""
import os
import signal
import threading

import pytest
import torch

from conftest import TIMEOUT
from swapio.offload import cpu_offload, remove_offload
from swapio.offload.api import _offloaded

pytestmark = pytest.mark.usefixtures("ctrl_c_raises")  # real SIGINTs raise even under an ignoring runner


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


def test_ctrl_c_after_a_preloaded_lock_leaves_the_model_to_other_threads():
    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(), Block()).requires_grad_(False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = net(x)
    cpu_offload(net, preload_module_classes=["Block"])
    lock = _offloaded[net].units[0].lock
    real = lock.acquire

    def acquire_then_ctrl_c(*args, **kwargs):  # the SIGINT arrives as the lock is taken
        got = real(*args, **kwargs)
        del lock.acquire  # (once)
        os.kill(os.getpid(), signal.SIGINT)
        return got

    lock.acquire = acquire_then_ctrl_c
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        net(x)
    out = {}
    other = threading.Thread(target=lambda: out.update(y=net(x)), daemon=True)
    other.start()
    other.join(TIMEOUT)
    assert not other.is_alive(), "another thread's forward waited for the interrupted call's lock"
    assert torch.equal(out["y"], expected)
    remove_offload(net)
