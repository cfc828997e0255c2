"""A backward that raises partway (an out-of-memory error in the middle of the model), caught by the user's loop,
then training goes on: with opt.zero_grad() or model.zero_grad() after catching it, or without (the next backward
sums on top of the gradients the failed one completed, as torch's .grad does). A tied weight whose second use the
failed backward never reached gets nothing from it, and a checkpointed block's gradients it did complete stay.
Each is checked against the same loop on the resident model (torch.equal on losses, weights and what the gradient
hooks saw), and nothing of the failed backward stays behind in the streamer. With in_backward=True, the updates
the failed backward made stay, as torch's optimizer-in-backward hooks leave them."""
import functools

import pytest
import torch
import torch.utils.checkpoint

from swapio.offload import remove_offload
from helpers.autograd import OnBackward
from swapio.offload.api import _offloaded
from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt,
                                      loss_of, offload, one_thread, weights)

pytest.importorskip("safetensors")
FAIL_AT = 2  # the step whose backward raises


def _fail_once(model):
    """In backward, once when the model is armed: the nodes after this point in forward (b, c) have run by then."""
    if model.armed:
        model.armed = False
        raise RuntimeError("out of memory (simulated)")


def _raise(x, model):
    return OnBackward.apply(x, functools.partial(_fail_once, model))


class FailingMLP(MLP):
    armed = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(_raise(self.norm(h), self)))
        return self.c(h)


class FailingTied(Tied):
    """The error comes after the head's use of the tied weight got its gradient, before the embedding's."""
    armed = False

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(_raise(self.emb(ids), self))))


class FailingCheckpointed(MLP):
    """norm and b under torch.utils.checkpoint: their recomputation in backward makes leaves that get no gradient,
    so the error after their backward must not take b's gradients for incomplete ones."""
    armed = False
    reentrant = False

    def forward(self, x):
        h = _raise(torch.tanh(self.a(x)), self)
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(self.norm(t))), h,
                                              use_reentrant=self.reentrant)
        return self.c(h)


def make(cls=FailingMLP, seed=0):
    torch.manual_seed(seed)
    return cls()


def run(model, opt, data, after_failure):
    """The user's loop: a RuntimeError in backward is caught, after_failure(model, opt) runs, the batch is skipped."""
    losses, seen = [], []
    (model.emb.weight if isinstance(model, Tied) else model.c.weight).register_hook(lambda g: seen.append(g.clone()))
    with one_thread():
        for i, b in enumerate(data):
            model.armed = i == FAIL_AT
            loss = loss_of(model, b)
            try:
                loss.backward()
            except RuntimeError as e:
                assert "simulated" in str(e)
                after_failure(model, opt)
                continue
            losses.append(loss.detach().clone())
            opt.step()
            opt.zero_grad()
    return losses, seen


def check(model, ref, got, want, hooks=5):
    assert_same_losses(got[0], want[0])
    assert len(got[1]) == len(want[1]) == hooks
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    streamer = _offloaded[model]
    # no leaf of a failed backward's graph is kept alive, nor its arrivals
    assert not [r for refs in streamer.training.made.values() for r in refs if r() is not None]
    assert not streamer.training.arrived
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
@pytest.mark.parametrize("zero", [True, False], ids=["zero_grad", "accumulate"])
def test_a_caught_failed_backward_then_training_goes_on_as_on_resident(tmp_path, storage, off, zero):
    data = batches(MLP, 5)
    after = (lambda m, o: o.zero_grad()) if zero else (lambda m, o: None)
    ref = make()
    with build_opt("AdamW", ref.parameters(), tmp_path / "r", offload=off) as opt:
        want = run(ref, opt, data, after)
    model = offload(make(), storage, tmp_path, FailingMLP)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", offload=off) as opt:
        got = run(model, opt, data, after)
    check(model, ref, got, want)


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
@pytest.mark.parametrize("after", ["nothing", "model.zero_grad"])
def test_a_tied_weights_use_that_got_its_gradient_before_the_error_is_dropped(tmp_path, storage, off, after):
    """autograd sums a leaf's inputs before accumulating them: the head's use of the tied weight, in before the
    error, never reaches .grad or a hook. It used to stay with the optimizer and was added to the next backward's
    gradient (or stepped by the next step())."""
    data = batches(Tied, 5)
    after_failure = {"nothing": lambda m, o: None, "model.zero_grad": lambda m, o: m.zero_grad()}[after]
    ref = make(FailingTied)
    with build_opt("AdamW", ref.parameters(), tmp_path / "r", offload=off) as opt:
        want = run(ref, opt, data, after_failure)
    model = offload(make(FailingTied), storage, tmp_path, FailingTied)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", offload=off) as opt:
        got = run(model, opt, data, after_failure)
    check(model, ref, got, want, hooks=4)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("after", ["nothing", "model.zero_grad"])
def test_a_failed_backward_through_a_checkpoint_keeps_what_it_completed(tmp_path, reentrant, after):
    data = batches(MLP, 5)
    after_failure = {"nothing": lambda m, o: None, "model.zero_grad": lambda m, o: m.zero_grad()}[after]
    ref = make(FailingCheckpointed)
    ref.reentrant = reentrant
    with build_opt("AdamW", ref.parameters(), tmp_path / "r") as opt:
        want = run(ref, opt, data, after_failure)
    model = offload(make(FailingCheckpointed), "disk", tmp_path, FailingCheckpointed)
    model.reentrant = reentrant
    with build_opt("AdamW", model.parameters(), tmp_path / "s", offload="nvme") as opt:
        got = run(model, opt, data, after_failure)
    check(model, ref, got, want)


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
@pytest.mark.parametrize("who", ["opt", "model"])
def test_in_backward_keeps_the_updates_the_failed_backward_made_as_optimizer_hooks_do(tmp_path, storage, off, who):
    """in_backward=True updated b and c before the error (their gradients were complete): as torch's
    optimizer-in-backward hooks would, i.e. the resident loop stepping the parameters that got a .grad. Then
    opt.zero_grad() or model.zero_grad() (which used to leave the next backward refused) and training goes on."""
    data = batches(MLP, 5)
    ref = make()
    with build_opt("AdamW", ref.parameters(), tmp_path / "r", offload=off) as opt:
        want = run(ref, opt, data, lambda m, o: (o.step(), o.zero_grad()))
    model = offload(make(), storage, tmp_path, FailingMLP)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", offload=off, in_backward=True) as opt:
        got = run(model, opt, data, lambda m, o: (o if who == "opt" else m).zero_grad())
        assert int(opt.state[model.c.weight]["step"]) == int(opt.state[model.a.weight]["step"]) + 1
    check(model, ref, got, want)


@pytest.mark.parametrize("who", ["opt", "model"])
def test_in_backward_options_changed_after_a_failed_backward_and_zero_grad_are_used_from_then_on(tmp_path, who):
    """An lr changed after a caught failed backward and zero_grad() (a scheduler stepped every iteration): the
    failed backward's updates are history, so the next step() is no "options changed after the updates used
    them" error (step() refuses those only while their gradients stand), and training equals the resident loop
    that stepped the failed backward's gradients with the old lr and then switched."""
    data = batches(MLP, 5)

    def switch(o):
        o.param_groups[0]["lr"] = 0.02
    ref = make()
    with build_opt("AdamW", ref.parameters(), tmp_path / "r") as opt:
        want = run(ref, opt, data, lambda m, o: (o.step(), o.zero_grad(), switch(o)))
    model = offload(make(), "disk", tmp_path, FailingMLP)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", in_backward=True) as opt:
        got = run(model, opt, data, lambda m, o: ((o if who == "opt" else m).zero_grad(), switch(o)))
    check(model, ref, got, want)


def test_in_backward_without_zero_grad_after_a_failed_backward_says_what_to_do(tmp_path):
    """The failed backward's updates were applied, so its gradients cannot be summed into the next one: the next
    backward is a RuntimeError naming the caught error and zero_grad(), and zero_grad() lets training go on."""
    data = batches(MLP, 5)
    model = offload(make(), "cpu", tmp_path, FailingMLP)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", in_backward=True) as opt, one_thread():
        model.armed = True
        with pytest.raises(RuntimeError, match="simulated"):
            loss_of(model, data[0]).backward()
        with pytest.raises(RuntimeError, match=r"(?s)raised partway.*zero_grad\(\)"):
            loss_of(model, data[1]).backward()
        opt.zero_grad()
        loss_of(model, data[1]).backward()
        opt.step()
        opt.zero_grad()
        # a backward that ended is one step: model.zero_grad() cannot undo its updates, so a second stays refused
        loss_of(model, data[2]).backward()
        model.zero_grad()
        with pytest.raises(RuntimeError, match="second backward before step"):
            loss_of(model, data[3]).backward()
    remove_offload(model)
