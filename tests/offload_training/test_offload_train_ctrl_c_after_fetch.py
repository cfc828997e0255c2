"""A Ctrl-C landing right after a module's weights were fetched, before the forward (or backward's refetch,
remove_offload's read, opt.param_value) kept the fetch:
the fetch stayed counted as in use for good, so every later optimizer step refused to rewrite those weights
("rewritten by an optimizer step while a module runs with them") and their ring space never came back. The
interrupted call now raises the KeyboardInterrupt with the fetch given back, and training goes on exactly as an
uninterrupted run's."""
import os
import signal

import pytest
import torch

import swapio.offload
from swapio.offload import disk_offload, remove_offload
from swapio.offload.fetch import Fetcher
from swapio.optim import OffloadAdamW

pytestmark = pytest.mark.usefixtures("ctrl_c_raises")  # real SIGINTs raise even under an ignoring runner


def trained(tmp_path, name):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    disk_offload(net, tmp_path / name, buffer_bytes=64 << 10)
    return net, OffloadAdamW(net.parameters(), lr=1e-2)


def step(net, opt, x):
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def remove(net, opt, x):
    remove_offload(net)


def param_value(net, opt, x):
    opt.param_value(net[1].weight)


def save_checkpoint(net, opt, x):
    swapio.offload.save_checkpoint(net, net.saved_to)


@pytest.mark.parametrize("where, interrupted", [("acquire", step), ("claim", step), ("acquire", remove),
                                                ("acquire", param_value), ("acquire", save_checkpoint)],
                         ids=["forward", "backward-refetch", "remove_offload", "param_value", "save_checkpoint"])
def test_ctrl_c_after_a_fetch_leaves_training_working(tmp_path, monkeypatch, where, interrupted):
    x = torch.randn(4, 32)
    reference, reference_opt = trained(tmp_path, "reference")
    for _ in range(2):
        step(reference, reference_opt, x)
    net, opt = trained(tmp_path, "interrupted")
    net.saved_to = tmp_path / "saved.safetensors"
    real, fired = getattr(Fetcher, where), []

    def then_ctrl_c(self, record):  # the SIGINT arrives as the fetch is handed over
        got = real(self, record)
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return got

    monkeypatch.setattr(Fetcher, where, then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        interrupted(net, opt, x)
    assert fired
    opt.zero_grad()
    monkeypatch.undo()
    for _ in range(2):
        step(net, opt, x)
    with torch.no_grad():
        assert torch.equal(net(x), reference(x))
    opt.close()
    reference_opt.close()
    remove_offload(net)
    remove_offload(reference)
