"""Two backwards of one offloaded model at once, in two threads (each of its own forward), made to overlap: a
barrier in the middle of the model holds each backward until the other got there too. With the accumulating
optimizer the gradients sum as torch's .grad sums them, and gradient hooks run once per backward on that
backward's gradient, as on the resident model (torch.equal). With in_backward=True (every backward is one step) it
is a RuntimeError. Every wait has a timeout: a hang fails the test."""
import threading

import pytest
import torch

from swapio.offload import remove_offload
from helpers.autograd import OnBackward
from helpers.offload_training import (MLP, assert_same_weights, batches, build_opt, loss_of, offload, one_thread,
                                      weights)

pytest.importorskip("safetensors")
TIMEOUT = 60


class MeetingMLP(MLP):
    barrier = None

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(OnBackward.apply(self.norm(h), self.barrier.wait)))  # the threads meet there
        return self.c(h)


def make():
    torch.manual_seed(0)
    return MeetingMLP()


def in_two_threads(fn, barrier):
    """fn(0) and fn(1) at once; the errors they raised (one raising breaks the barrier the other waits at)."""
    errors = [None, None]

    def run(i):
        try:
            fn(i)
        except BaseException as e:  # noqa: B036 - handed to the test
            errors[i] = e
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a backward hung"
    return errors


def train(model, opt, data, seen):
    model.c.weight.register_hook(lambda g: seen.append(g.clone().clamp_(-0.01, 0.01)) or g.clamp(-0.01, 0.01))
    with one_thread():
        for k in range(0, len(data), 2):
            model.barrier = threading.Barrier(2, timeout=TIMEOUT)
            errors = in_two_threads(lambda i: loss_of(model, data[k + i]).backward(), model.barrier)
            assert errors == [None, None], errors
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
def test_two_backwards_at_once_sum_as_on_resident(tmp_path, storage, off):
    """They used to share one count of the gradients in flight: each backward's first gradient reset the other's,
    so a use of a weight lost its gradient or hooks ran on two backwards' sum, without a word."""
    data = batches(MLP, 4)
    ref, want = make(), []
    with build_opt("AdamW", ref.parameters(), tmp_path / "r", offload=off) as opt:
        train(ref, opt, data, want)
    model, got = offload(make(), storage, tmp_path, MeetingMLP), []
    with build_opt("AdamW", model.parameters(), tmp_path / "s", offload=off) as opt:
        train(model, opt, data, got)
    assert len(got) == len(want) == len(data)
    # the two threads' hooks run in either order: compare them as a set per step
    for k in range(0, len(data), 2):
        assert any(all(torch.equal(a, b) for a, b in zip(got[k:k + 2], pair))
                   for pair in (want[k:k + 2], want[k:k + 2][::-1]))
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def test_two_backwards_at_once_with_in_backward_is_a_runtime_error(tmp_path):
    data = batches(MLP, 2)
    model = offload(make(), "cpu", tmp_path, MeetingMLP)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", in_backward=True) as opt, one_thread():
        model.barrier = threading.Barrier(2, timeout=TIMEOUT)
        errors = in_two_threads(lambda i: loss_of(model, data[i]).backward(), model.barrier)
        assert any(isinstance(e, RuntimeError) and "in_backward=True every backward is one step" in str(e)
                   for e in errors), errors
        opt.zero_grad()
        model.barrier = threading.Barrier(1)
        loss_of(model, data[0]).backward()  # the model trains on
        opt.step()
    remove_offload(model)
