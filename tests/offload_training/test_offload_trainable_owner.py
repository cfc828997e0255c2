"""The seam between offloaded weights and whoever trains them: swapio.offload calls an owner only through
TrainableOwner (offload/trainable.py), and an owner rewrites weights only through Training's public methods. An
owner written against that protocol alone (no swapio.optim) gets each weight's gradient as the resident model
computes it, its rewrites reach the next forward, and remove_offload flushes it through the protocol."""
import copy

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload
from swapio.offload.trainable import TrainableOwner
from swapio.offload.training import lookup
from helpers.offload import one_thread


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(model):
    torch.manual_seed(1)
    x = torch.randn(5, 8)
    return model(x).square().sum()


class SgdOwner(TrainableOwner):
    """Plain SGD over offloaded weights, through the protocol and Training's public methods only."""

    def __init__(self, params, lr):
        self.lr, self.grads, self.calls, self.entries = lr, {}, [], {}
        for p in params:
            training, slot = lookup(p)
            training.claim(slot, self)
            self.entries[slot] = (training, p)

    def gradient(self, slot, grad, complete, backward):
        self.calls.append(("gradient", slot.name, complete))
        g = grad.detach().clone()
        self.grads[slot] = g if slot not in self.grads else self.grads[slot] + g

    def flush(self):
        self.calls.append(("flush",))

    def step(self):
        for slot, g in self.grads.items():
            training = self.entries[slot][0]
            buf = training.begin(slot.record, True)
            try:
                training.view(buf, slot).sub_(self.lr * g)
            except BaseException:
                training.abort(slot.record)
                raise
            training.end(slot.record, buf)
            training.flush()
        self.grads = {}


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_an_owner_of_the_protocol_alone_gets_the_gradients_and_trains_the_weights(tmp_path, kind):
    ref = _model()
    model = copy.deepcopy(ref)
    if kind == "cpu":
        cpu_offload(model)
    else:
        disk_offload(model, tmp_path / "od")
    owner = SgdOwner(list(model.parameters()), lr=0.1)
    with one_thread():
        _loss(ref).backward()
        _loss(model).backward()
    by_name = dict(ref.named_parameters())
    assert {name for _, name, _ in owner.calls} == set(by_name)
    assert all(complete for _, _, complete in owner.calls)
    for slot, g in owner.grads.items():
        assert torch.equal(g, by_name[slot.name].grad)
    owner.step()
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * p.grad)
        want = ref(torch.ones(2, 8))
        got = model(torch.ones(2, 8))  # the next forward reads the rewritten weights
    assert torch.equal(got, want)
    remove_offload(model)
    assert owner.calls[-1] == ("flush",)  # remove_offload reached the owner through TrainableOwner.flush
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), by_name[name].detach())


def test_claiming_for_an_object_that_is_no_trainable_owner_is_a_type_error():
    model = _model()
    cpu_offload(model)
    training, slot = lookup(next(model.parameters()))

    class DuckOwner:  # has the methods, not the protocol: offload must not find it by duck typing
        def gradient(self, slot, grad, complete):
            pass

    with pytest.raises(TypeError, match="TrainableOwner"):
        training.claim(slot, DuckOwner())
    remove_offload(model)


def test_an_owner_that_does_not_take_gradients_fails_the_backward_loudly():
    model = _model()
    cpu_offload(model)
    owner = TrainableOwner()
    for p in model.parameters():
        training, slot = lookup(p)
        training.claim(slot, owner)
    with one_thread(), pytest.raises(NotImplementedError, match="takes no gradients"):
        _loss(model).backward()
    remove_offload(model)
