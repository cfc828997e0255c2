"""One ActivationOffload entered again inside its own `with` (a model calling a submodule that enters it too), with
the inner block failing or not, and from several threads at once: each forward is its own session, gradients
bit-equal to the run without offload, nothing left after."""
import gc
import threading

import pytest
import torch

from helpers.activations import hooks_installed, swap_files
from swapio.offload import offload_activations


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))


def _assert_clean(act):
    gc.collect()
    assert not hooks_installed() and swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0


@pytest.mark.parametrize("inner_fails", [False, True], ids=["inner-ends", "inner-raises"])
def test_the_same_offload_entered_inside_its_own_block(tmp_path, inner_fails):
    model, x = _model(), torch.randn(16, 32, requires_grad=True)
    want = torch.autograd.grad(model(x).sum() + model(x).exp().sum(), [x, *model.parameters()])
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    with act:
        first = model(x).sum()
        try:
            with act:
                inner = model(x).square().sum()
                if inner_fails:
                    raise ValueError("inner forward failed")
        except ValueError:
            pass
        assert hooks_installed()  # the outer block's hooks are on again
        last = model(x).exp().sum()
    if inner_fails:
        with pytest.raises(RuntimeError, match="discarded"):
            inner.backward()
    else:
        inner.backward()
    got = torch.autograd.grad(first + last, [x, *model.parameters()])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert act.stats()["tensors"] >= 5  # tanh outputs, the square's input, the exp's output
    del first, inner, last
    _assert_clean(act)
    act.close()


def test_one_offload_used_by_four_threads_at_once(tmp_path):
    model = _model()
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=4096)
    start, errors = threading.Barrier(4), []

    def train(seed):
        try:
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
            want = torch.autograd.grad(model(x).tanh().square().sum(), x)[0]
            start.wait()
            for _ in range(10):
                with act:
                    loss = model(x).tanh().square().sum()
                if not torch.equal(torch.autograd.grad(loss, x)[0], want):
                    errors.append(f"thread {seed}: gradient differs")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {seed}: {exc!r}")
    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert act.stats()["tensors"] >= 4 * 10 * 2
    _assert_clean(act)
    act.close()
