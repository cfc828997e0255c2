"""fork() after an in_backward=True optimizer of offloaded weights has run its worker thread (a pool started by
fork, a fork-based search): that thread is not in the child, and the child's next step() waited forever for work
handed to it. A child forked while the worker was idle trains exactly as the parent does; one forked while it was
updating weights (half-updated state), or while a backward handed it a gradient, is told so by a RuntimeError, never
a hang on the parent's thread or lock; the parent carries on."""
import threading

import pytest
import torch

import swapio.optim.offloaded as offloaded
from conftest import TIMEOUT
from helpers.fork import run_in_child
from swapio.offload import cpu_offload
from swapio.optim import OffloadAdamW


def trained(in_backward=True):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    cpu_offload(net)
    opt = OffloadAdamW(net.parameters(), lr=1e-2, in_backward=in_backward)
    return net, opt


def step(net, opt, x):
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        return net(x)


def fork_while_a_backward_is_inside(monkeypatch, net, x, method, in_child):
    """Forks while a backward of another thread is held inside OffloadedParams.<method>; in_child() must raise a
    RuntimeError naming the fork in the child. The backward is let go and joined after."""
    started, release, real = threading.Event(), threading.Event(), getattr(offloaded.OffloadedParams, method)

    def held(self, *args, **kwargs):
        started.set()
        assert release.wait(TIMEOUT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(offloaded.OffloadedParams, method, held)
    backward = threading.Thread(target=lambda: net(x).square().mean().backward())
    backward.start()
    try:
        assert started.wait(TIMEOUT)

        def child():
            with pytest.raises(RuntimeError, match="fork"):
                in_child()

        assert run_in_child(child) == 0
    finally:
        release.set()
        backward.join(TIMEOUT)


def test_a_child_forked_while_the_worker_is_idle_trains_as_the_parent(tmp_path):
    net, opt = trained()
    x = torch.randn(4, 32)
    step(net, opt, x)  # the worker thread exists now

    def child():
        torch.save(step(net, opt, x), tmp_path / "child.pt")

    assert run_in_child(child) == 0
    assert torch.equal(torch.load(tmp_path / "child.pt"), step(net, opt, x))
    opt.close()


def test_a_child_forked_while_the_worker_updates_is_refused(monkeypatch):
    net, opt = trained()
    x = torch.randn(4, 32)
    step(net, opt, x)
    fork_while_a_backward_is_inside(monkeypatch, net, x, "update", opt.step)  # (the worker, busy updating)
    opt.step()
    opt.zero_grad()
    monkeypatch.undo()
    step(net, opt, x)
    opt.close()


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_child_forked_while_a_backward_hands_over_a_gradient_is_refused(monkeypatch, in_backward):
    net, opt = trained(in_backward)
    x = torch.randn(4, 32)
    step(net, opt, x)
    reference, reference_opt = trained(in_backward)  # the same two steps, undisturbed
    step(reference, reference_opt, x)
    expected = step(reference, reference_opt, x)
    reference_opt.close()
    # (a backward thread inside the optimizer, its lock held)
    fork_while_a_backward_is_inside(monkeypatch, net, x, "_accept_one", lambda: net(x).square().mean().backward())
    monkeypatch.undo()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        assert torch.equal(net(x), expected)  # the parent's second step, as an undisturbed run's
    opt.close()
