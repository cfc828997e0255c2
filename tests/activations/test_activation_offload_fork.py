"""fork() with an ActivationOffload to="nvme" alive (DataLoader workers and multiprocessing pools fork like this):
its swap directory and handle are the parent's, so the child's `with` is refused up front (no file made in the
parent's directory, no hang on a lock another thread held at the fork), and the child's close() leaves the
parent's saved activations alone: the parent's backward still gets torch's own gradients."""
import os
import threading

import pytest
import torch

from conftest import TIMEOUT
from helpers.fork import run_in_child
from swapio.offload import offload_activations


def model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU()) for _ in range(3)])
    return model, torch.randn(300, 128, requires_grad=True)


def gradients(model, x):
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def reference():
    model, x = model_and_input()
    model(x).square().mean().backward()
    return gradients(model, x)


def files(directory):
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("thread_inside", [False, True], ids=["between-saves", "while-a-thread-saves"])
def test_a_forked_child_is_refused_and_leaves_the_parents_activations_alone(tmp_path, thread_inside):
    model, x = model_and_input()
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=1 << 14)
    with act:
        loss = model(x).square().mean()
    saved = files(act.directory)
    assert saved  # the parent's activations are in their swap file, waiting for its backward
    held, release = threading.Event(), threading.Event()

    def saving():  # the lock a save holds while it stages and writes a tensor (Session.pack)
        with act._res.lock:
            held.set()
            release.wait(TIMEOUT)

    thread = threading.Thread(target=saving)
    if thread_inside:
        thread.start()
        assert held.wait(TIMEOUT)

    def child():
        with pytest.raises(RuntimeError, match="fork"):
            with act:
                model(x)
        assert files(act.directory) == saved  # nothing made in the parent's directory
        act.close()
        assert files(act.directory) == saved  # nor removed from it

    try:
        assert run_in_child(child) == 0
    finally:
        release.set()
        if thread_inside:
            thread.join(TIMEOUT)
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(gradients(model, x), reference()))
    act.close()
    assert not os.path.exists(act.directory)
