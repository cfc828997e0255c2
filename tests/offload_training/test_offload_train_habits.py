"""Users' habits on offloaded weights trained by a swapio optimizer: torch's and accelerate's clipping, p.grad
zeroed or dropped, gradient hooks registered on model.parameters(), a second step() without a new backward,
clipping twice and clipping bf16 weights. Each either works exactly as on the resident model (torch.equal
against the same loop on a resident copy) or fails loudly before anything changed."""
import contextlib
import threading

import pytest
import torch

from swapio.offload import offload_activations, remove_offload
from swapio.offload.api import _offloaded
from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt, loss_of,
                                      make_model, offload, one_thread, train, weights)

pytest.importorskip("safetensors")


def both(tmp_path, off, storage="disk", dtype=torch.float32, cls=MLP, keep=(), **kw):
    """(resident model, its optimizer), (offloaded copy, its optimizer): the same weights and options."""
    ref = make_model(cls, dtype)
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref-swap", offload=off,
                        **{k: v for k, v in kw.items() if k != "in_backward"})
    model = offload(make_model(cls, dtype), storage, tmp_path, cls, dtype, keep_resident=list(keep))
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off, **kw)
    return (ref, ref_opt), (model, opt)


def finish(pairs):
    """Closes the optimizers, brings the offloaded model back, and checks every weight is the resident one's."""
    (ref, ref_opt), (model, opt) = pairs
    ref_opt.close()
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def values(model, opt):
    return {n: opt.param_value(p).clone() for n, p in model.named_parameters()}


# ---- torch's and accelerate's clipping ------------------------------------------------------------------------
@pytest.mark.parametrize("storage,off,keep", [("disk", "nvme", ()), ("cpu", "cpu", ()), ("disk", "cpu", ("c",)),
                                              ("cpu", "nvme", ("a",))])
def test_torch_clip_grad_norm_is_refused_naming_opt_clip_and_changes_nothing(tmp_path, storage, off, keep):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) used to return a meta norm, leave every offloaded
    weight unstepped by the next step() and make opt.clip_grad_norm_ report 0. Now: a RuntimeError naming
    opt.clip_grad_norm_, no gradient changed (resident ones included), and opt.clip_grad_norm_ + step() then give
    exactly what torch's clipping gives on the resident model."""
    data = batches(MLP, 2)
    pairs = both(tmp_path, off, storage, keep=keep)
    (ref, ref_opt), (model, opt) = pairs
    with one_thread():
        for b in data:
            loss_of(ref, b).backward()
            loss_of(model, b).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        resident = {n: p.grad.clone() for n, p in model.named_parameters() if p.device.type != "meta"}
        assert len(resident) == 2 * len(keep)
        with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_") as info:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        assert "offloaded weight" in str(info.value)
        for n, p in model.named_parameters():
            if n in resident:
                assert torch.equal(p.grad, resident[n]), n
        assert torch.equal(opt.clip_grad_norm_(0.05), want)
        ref_opt.step()
        opt.step()
    finish(pairs)


def test_accelerate_clip_grad_norm_is_refused_naming_opt_clip(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    data = batches(MLP, 1)
    pairs = both(tmp_path, "cpu", "disk")
    (ref, ref_opt), (model, opt) = pairs
    accelerator = accelerate.Accelerator(cpu=True)
    with one_thread():
        loss_of(ref, data[0]).backward()
        loss_of(model, data[0]).backward()
        with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):
            accelerator.clip_grad_norm_(model.parameters(), 0.05)
        assert torch.equal(opt.clip_grad_norm_(0.05), accelerator.clip_grad_norm_(ref.parameters(), 0.05))
        ref_opt.step()
        opt.step()
    finish(pairs)


@pytest.mark.parametrize("in_backward", [False, True])
def test_reading_an_offloaded_grad_is_refused(tmp_path, in_backward):
    """p.grad of an offloaded weight has no values: computing with it (a norm, a scale, a copy) raises instead
    of giving a meta tensor."""
    model = offload(make_model(), "cpu", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", in_backward=in_backward) as opt, one_thread():
        loss_of(model, batches(MLP, 1)[0]).backward()
        g = model.b.weight.grad
        assert g is not None and g.shape == model.b.weight.shape and g.dtype == model.b.weight.dtype
        for use in (lambda: g.norm(), lambda: g.mul_(0.5), lambda: g.clone(), lambda: torch.linalg.vector_norm(g)):
            with pytest.raises(RuntimeError, match=r"'b\.weight'.*opt\.clip_grad_norm_"):
                use()
        opt.step()
    remove_offload(model)


@pytest.mark.parametrize("off", ["cpu", "nvme"])
@pytest.mark.parametrize("how", ["zero_", "none"])
@pytest.mark.parametrize("who", ["model", "opt"])
def test_zero_grad_zeroes_or_drops_like_grad(tmp_path, off, how, who):
    """zero_grad(set_to_none=False) (the model's or the optimizer's) zeroes .grad: a step() right after steps
    with zero gradients (weight decay and momentum still move the weights), and a backward after it starts from
    zero; set_to_none drops it. Both as on the resident model (zeroing used to drop the sum: the weights stayed
    put)."""
    data = batches(MLP, 3)
    pairs = both(tmp_path, off)
    with one_thread():
        for m, o in pairs:
            clear = (m if who == "model" else o).zero_grad
            loss_of(m, data[0]).backward()
            o.step()
            clear(set_to_none=how == "none")
            o.step()  # zero_(): zero gradients; none: nothing to step
            loss_of(m, data[1]).backward()
            clear(set_to_none=how == "none")
            loss_of(m, data[2]).backward()
            o.step()
    for p in pairs[1][0].parameters():
        assert int(pairs[1][1].state[p]["step"]) == (3 if how == "zero_" else 2)
    finish(pairs)


# ---- gradient hooks on model.parameters() -------------------------------------------------------------------
def hooks(model, calls):
    """Hooks as users register them: b's gradients zeroed, a's halved (register_hook), a post-accumulate hook
    counting on every parameter; calls counts per kind."""
    def zero(g):
        calls["zero"] += 1
        return torch.zeros_like(g)

    def half(g):
        calls["half"] += 1
        return g * 0.5

    def post(p):
        calls["post"] += 1
        assert p.grad is not None

    for p in model.b.parameters():
        p.register_hook(zero)
    for p in model.a.parameters():
        p.register_hook(half)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(post)


@pytest.mark.parametrize("storage,off,in_backward,micro", [("disk", "nvme", False, 2), ("cpu", "cpu", False, 1),
                                                           ("disk", "cpu", True, 1), ("cpu", "nvme", True, 1)])
def test_gradient_hooks_on_parameters_run_as_on_resident(tmp_path, storage, off, in_backward, micro):
    """p.register_hook and p.register_post_accumulate_grad_hook on model.parameters() used to be ignored (each
    forward makes a fresh leaf): a hook zeroing b's gradient ran 0 times and b trained. Now they run as often as
    on the resident model, on the gradient the optimizer uses."""
    data = batches(MLP, 3 * micro)
    pairs = both(tmp_path, off, storage, in_backward=in_backward)
    counts = []
    for m, o in pairs:
        calls = {"zero": 0, "half": 0, "post": 0}
        hooks(m, calls)
        with one_thread():
            for k in range(0, len(data), micro):
                for b in data[k:k + micro]:
                    loss_of(m, b).backward()
                o.step()
                o.zero_grad()
        counts.append(calls)
    assert counts[0] == counts[1] and counts[0]["zero"] == 2 * len(data)
    finish(pairs)


@pytest.mark.parametrize("in_backward", [False, True])
def test_post_accumulate_hook_zeroing_or_dropping_grad(tmp_path, in_backward):
    """A post-accumulate hook that zeroes b's .grad (b steps with zeros) and sets c's to None (c is not
    stepped), as on the resident model."""
    data = batches(MLP, 2)
    pairs = both(tmp_path, "cpu", in_backward=in_backward)

    def post(p):
        if p.shape == pairs[0][0].b.weight.shape:
            p.grad.zero_()
        elif p.shape == pairs[0][0].c.weight.shape:
            p.grad = None

    for m, o in pairs:
        m.b.weight.register_post_accumulate_grad_hook(post)
        m.c.weight.register_post_accumulate_grad_hook(post)
        with one_thread():
            for b in data:
                loss_of(m, b).backward()
                o.step()
                o.zero_grad()
    model, opt = pairs[1]
    assert not opt.state.get(model.c.weight) and int(opt.state[model.b.weight]["step"]) == 2
    finish(pairs)


def test_gradient_hook_on_a_tied_weight_runs_once_per_backward_on_the_sum(tmp_path):
    """A tied weight (one placeholder, used twice in forward) gets its hook once per backward with the sum of
    both uses' gradients, as torch runs a leaf's hook once on its summed input."""
    data = batches(Tied, 2)
    pairs = both(tmp_path, "cpu", cls=Tied)
    seen = []
    for m, o in pairs:
        got = []
        m.emb.weight.register_hook(lambda g, got=got: got.append(g.clone()) or g * 0.25)
        with one_thread():
            for b in data:
                loss_of(m, b).backward()
                o.step()
                o.zero_grad()
        seen.append(got)
    assert len(seen[0]) == len(seen[1]) == 2
    for a, b in zip(*seen):
        assert torch.equal(a, b)
    finish(pairs)


# ---- a second step() without a new backward (in_backward=True) ---------------------------------------------
def test_in_backward_second_step_without_backward_is_refused_before_any_change(tmp_path):
    """torch steps again with the same .grad; in_backward=True applied the gradient in backward and keeps none,
    so a second step() used to do nothing for the offloaded weights (counts 1 against 2) while stepping the
    resident ones. Now: a RuntimeError naming zero_grad and in_backward, resident and offloaded unchanged."""
    data = batches(MLP, 2)
    model = offload(make_model(), "disk", tmp_path, keep_resident=["c"])
    with build_opt("AdamW", model.parameters(), tmp_path / "s", offload="nvme", in_backward=True) as opt, \
            one_thread():
        loss_of(model, data[0]).backward()
        opt.step()
        before = values(model, opt)
        with pytest.raises(RuntimeError, match=r"(?s)zero_grad.*in_backward=False"):
            opt.step()
        after = values(model, opt)
        assert all(torch.equal(after[n], before[n]) for n in before)
        assert {int(opt.state[p]["step"]) for p in model.parameters()} == {1}
        opt.zero_grad()
        opt.step()  # nothing to step: as torch after zero_grad()
        loss_of(model, data[1]).backward()
        opt.step()
        assert {int(opt.state[p]["step"]) for p in model.parameters()} == {2}
    remove_offload(model)


@pytest.mark.parametrize("clear", ["none", "model", "model_zero_"])
def test_in_backward_backward_after_step_needs_cleared_grads(tmp_path, clear):
    """A backward after step() while p.grad still shows the applied gradient: torch would step with the sum of
    both, in_backward=True cannot: a RuntimeError. After model.zero_grad() (either kind) it trains exactly as
    the resident model."""
    data = batches(MLP, 3)
    pairs = both(tmp_path, "cpu", in_backward=True)
    (ref, ref_opt), (model, opt) = pairs
    with one_thread():
        for m, o in pairs:
            loss_of(m, data[0]).backward()
            o.step()
        if clear == "none":
            with pytest.raises(RuntimeError, match=r"(?s)zero_grad.*in_backward=False"):
                loss_of(model, data[1]).backward()
            opt.zero_grad()
            ref_opt.zero_grad()
        else:
            for m, _ in pairs:
                m.zero_grad(set_to_none=clear == "model")
        for m, o in pairs:
            for b in data[1:]:
                loss_of(m, b).backward()
                o.step()
                m.zero_grad()
    finish(pairs)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
@pytest.mark.parametrize("edit", ["lr", "betas", "amsgrad_on", "amsgrad_off", "scheduler_first"])
@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
def test_in_backward_options_changed_between_backward_and_step_are_refused(tmp_path, edit, storage, off):
    """torch's step() uses a group's options as they are at step(); in_backward=True's updates ran during
    backward with those of then. An lr (or betas) set between backward and step(), or an lr scheduler stepped
    before opt.step(), used to be applied to whichever records the worker had not reached yet (the rest kept the
    old value): training silently off torch's. Now step() raises, before stepping anything more (the resident
    weights included); with the options set back it steps, and training goes on exactly as the resident model's
    with the options never changed."""
    data = batches(MLP, 3)
    pairs = both(tmp_path, off, storage, keep=("c",), in_backward=True, amsgrad=edit == "amsgrad_off")
    (ref, ref_opt), (model, opt) = pairs
    with one_thread():
        for m, o in pairs:
            loss_of(m, data[0]).backward()
        opt.param_value(model.a.weight)  # waits for the updates backward began: they have run
        before = values(model, opt)
        group = opt.param_groups[0]
        old = dict(group)
        if edit == "lr":
            group["lr"] = 0.5
        elif edit == "betas":
            group["betas"] = (0.5, 0.9)
        elif edit.startswith("amsgrad"):  # whether the updates kept max_exp_avg_sq (off: silently mixed)
            group["amsgrad"] = not group["amsgrad"]
        else:
            torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1).step()
        with pytest.raises(RuntimeError, match=r"(?s)options changed after in_backward=True.*in_backward=False"):
            opt.step()
        after = values(model, opt)
        assert all(torch.equal(after[n], before[n]) for n in before)  # c (resident) not stepped either
        group.update({k: old[k] for k in ("lr", "betas", "amsgrad")})
        opt.step()
        ref_opt.step()
        for m, o in pairs:
            o.zero_grad()
            train(m, o, data[1:])
    finish(pairs)


def test_in_backward_options_changed_then_zero_grad_goes_on(tmp_path):
    """zero_grad() after the refused step(): the updates of that backward are history, the next steps use the
    new options, as a resident run that stepped with the old lr and then switched."""
    data = batches(MLP, 3)
    pairs = both(tmp_path, "cpu", in_backward=True)
    (ref, ref_opt), (model, opt) = pairs
    with one_thread():
        for m, o in pairs:
            loss_of(m, data[0]).backward()
        opt.param_value(model.a.weight)
        opt.param_groups[0]["lr"] = 0.05
        with pytest.raises(RuntimeError, match="options changed"):
            opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_opt.param_groups[0]["lr"] = 0.05
        for m, o in pairs:
            train(m, o, data[1:])
    finish(pairs)


# ---- opt.clip_grad_norm_: twice, and bf16 weights ------------------------------------------------------------
@pytest.mark.parametrize("storage,off,dtype,micro", [("disk", "nvme", torch.float32, 2),
                                                     ("cpu", "cpu", torch.float32, 1),
                                                     ("disk", "nvme", torch.bfloat16, 1),
                                                     ("cpu", "cpu", torch.bfloat16, 1),
                                                     ("disk", "nvme", torch.float16, 1)])
def test_clip_twice_and_low_precision_equal_torch_on_resident(tmp_path, storage, off, dtype, micro):
    """opt.clip_grad_norm_ called twice per step (nvme kept the first norm scaled by the factor instead of the
    norm of the scaled sums: 1 ulp off, weights 3e-8 off), and on bf16/fp16 weights (offloaded sums gave an
    fp32 norm where torch gives the weights' dtype, and scaled them without rounding: losses parted from step
    2): norms, losses and weights equal torch.nn.utils.clip_grad_norm_ on the resident model, bit for bit."""
    data = batches(MLP, 3 * micro)
    pairs = both(tmp_path, off, storage, dtype)
    results = []
    for m, o in pairs:
        norms, losses = [], []
        with one_thread():
            for k in range(0, len(data), micro):
                for b in data[k:k + micro]:
                    loss = loss_of(m, b)
                    loss.backward()
                    losses.append(loss.detach())
                for max_norm in (0.5, 0.05):
                    if m is pairs[0][0]:
                        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
                    else:
                        norms.append(o.clip_grad_norm_(max_norm))
                o.step()
                o.zero_grad()
        results.append((norms, losses))
    (want_norms, want_losses), (got_norms, got_losses) = results
    assert_same_losses(got_losses, want_losses)
    for g, w in zip(got_norms, want_norms):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
    assert all(float(w) > 0.05 for w in want_norms[1::2])  # the second clip clips too
    finish(pairs)


def mixed_dtypes_mlp():
    """MLP with a in bf16, norm and b in fp32, c in fp16: the parameters' order is not the order of torch's
    grouping by dtype."""
    model = make_model()
    model.a.to(torch.bfloat16)
    model.c.to(torch.float16)
    return model


def mixed_dtypes_loss(model, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.tanh(model.b(model.norm(torch.tanh(model.a(x)))))
        out = model.c(h)
    return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize("storage,off", [(None, "cpu"), (None, "nvme"), ("disk", "nvme"), ("cpu", "cpu")])
def test_clip_of_mixed_dtypes_equals_torch_on_resident(tmp_path, storage, off):
    """torch.nn.utils.clip_grad_norm_ groups the gradients by device and dtype and stacks their norms group by
    group (fp16, fp32, bf16 here); opt.clip_grad_norm_ stacked them in parameter order, so with weights of several
    dtypes (a model half in bf16, under autocast) its norm was 1 ulp off torch's, and the weights parted. Now the
    norms, losses and weights equal torch's clipping of the resident model bit for bit, for a swapio optimizer
    over the resident model too (storage None)."""
    data = batches(MLP, 3)
    ref = mixed_dtypes_mlp()
    model = mixed_dtypes_mlp()
    if storage is not None:
        model = offload(model, storage, tmp_path)
    results = []
    for m, where in ((ref, "ref-swap"), (model, "swap")):
        norms, losses = [], []
        with build_opt("AdamW", m.parameters(), tmp_path / where, offload=off) as o, one_thread():
            for b in data:
                loss = mixed_dtypes_loss(m, b)
                loss.backward()
                losses.append(loss.detach())
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1) if m is ref
                             else o.clip_grad_norm_(0.1))
                o.step()
                o.zero_grad()
        results.append((norms, losses))
    (want_norms, want_losses), (got_norms, got_losses) = results
    assert all(float(w) > 0.1 for w in want_norms)  # each clip scales
    for g, w in zip(got_norms, want_norms):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
    assert_same_losses(got_losses, want_losses)
    if storage is not None:
        remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


# ---- a forward before step(), its backward after --------------------------------------------------------------
def backward_after_step(model, opts, data, which):
    """The forward of data[1] before opts[which].step() (of data[0]'s gradients), its backward after: "ok", or
    "modified" for autograd's error about a saved tensor changed in place. Then a plain step on data[2]."""
    with one_thread():
        loss_of(model, data[0]).backward()
        pending = loss_of(model, data[1])
        opts[which].step()
        for o in opts:
            o.zero_grad()
        try:
            pending.backward()
            outcome = "ok"
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e), e
            outcome = "modified"
        for o in opts:
            o.zero_grad()
        loss_of(model, data[2]).backward()
        for o in opts:
            o.step()
    return outcome


@pytest.mark.parametrize("which", [0, 1], ids=["weights_stepped", "biases_stepped"])
@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("disk", "cpu"), ("cpu", "cpu")])
def test_backward_of_a_forward_made_before_a_step_is_refused_as_on_resident(tmp_path, storage, off, which):
    """A graph built before step() and differentiated after it (a GAN's generator loss through a discriminator
    stepped meanwhile): autograd refuses it on the resident model, since the step changed saved weights in place.
    disk_offload fetched the weights again in backward, the new ones, and computed gradients of weights the forward
    never used without a word. Now the same error where the stepped weights were saved (weights: Linear saves them),
    none where they were not (biases), and training goes on exactly as the resident model's."""
    data = batches(MLP, 3)

    def opts(model, where):
        named = list(model.named_parameters())
        return [build_opt("AdamW", [p for n, p in named if n.endswith(suffix) and not n.startswith("norm")],
                          tmp_path / where / suffix, offload=off) for suffix in ("weight", "bias")] + \
               [build_opt("AdamW", model.norm.parameters(), tmp_path / where / "norm", offload=off)]
    ref = make_model()
    ref_opts = opts(ref, "ref")
    model = offload(make_model(), storage, tmp_path)
    model_opts = opts(model, "offloaded")
    want = backward_after_step(ref, ref_opts, data, which)
    assert backward_after_step(model, model_opts, data, which) == want
    assert want == ("modified" if which == 0 else "ok")
    for o in ref_opts + model_opts:
        o.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("disk", "cpu"), ("cpu", "cpu")])
def test_in_backward_forward_before_step_and_its_backward_after_trains_as_torch(tmp_path, storage, off):
    """With in_backward=True the update is part of backward: a forward made after a backward (before step()) sees
    the updated weights, as with torch's optimizer-in-backward hooks, so its backward after step() is a next step.
    step() forgot the leaves of forwards made before it: the first gradient of a module (its bias) then found none
    of its weight and updated the module without it, and the weight's gradient was a "second backward"
    RuntimeError (disk_offload). Now the losses and weights equal a resident run that steps after each backward."""
    data = batches(MLP, 3)
    (ref, ref_opt), (model, opt) = both(tmp_path, off, storage, in_backward=True)
    with one_thread():
        ref_losses = []
        for b in data:
            loss = loss_of(ref, b)
            ref_losses.append(loss.item())
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        first = loss_of(model, data[0])
        first.backward()
        pending = loss_of(model, data[1])  # after backward's updates, before step()
        opt.step()
        opt.zero_grad()
        pending.backward()
        opt.step()
        opt.zero_grad()
        last = loss_of(model, data[2])
        last.backward()
        opt.step()
    assert [first.item(), pending.item(), last.item()] == ref_losses
    finish(((ref, ref_opt), (model, opt)))


def test_losses_kept_alive_across_steps_leave_each_backward_a_bounded_number_of_leaves(tmp_path):
    """A program that keeps its losses (appended or summed without .item()) keeps every step's graph, and the
    leaves those forwards made of the offloaded weights. Each gradient looks at the leaves tracked for its weight:
    once they were kept for good, a backward after 1,000 steps took 14 times as long. Leaves of forwards older than
    the last step() are let go (those made before it stay: their backward may come after it); training equals the
    resident run."""
    data = batches(MLP, 2)
    pairs = both(tmp_path, "cpu", "disk")
    kept = []
    with one_thread():
        for m, o in pairs:
            for i in range(12):
                loss = loss_of(m, data[i % 2])
                loss.backward()
                o.step()
                o.zero_grad()
                kept.append(loss)  # the graph stays alive (its saved tensors were freed by backward)
    training = _offloaded[pairs[1][0]].training
    live = [r for refs in (*training.made.values(), *training.made_before.values()) for r in refs if r() is not None]
    assert len(live) <= 2 * len(list(pairs[1][0].parameters()))  # this step's and the one before's, not twelve
    finish(pairs)


# ---- requires_grad_ toggled between forward and backward ---------------------------------------------------------
@pytest.mark.parametrize("storage,off,in_backward", [("disk", "nvme", False), ("cpu", "cpu", False),
                                                     ("disk", "cpu", True), ("cpu", "nvme", True)])
def test_a_weight_frozen_between_forward_and_backward_gets_no_gradient_as_on_resident(tmp_path, storage, off,
                                                                                     in_backward):
    """autograd accumulates nothing into a parameter that no longer requires grad when backward reaches it
    (p.requires_grad_(False) after the forward): .grad stays None and the step leaves it. The offloaded weight's
    gradient went to the optimizer all the same (the forward's leaf of it still required grad), which stepped it.
    Now p.grad stays None, and losses and weights equal the resident model's (the other weights of its module
    included)."""
    data = batches(MLP, 4)
    pairs = both(tmp_path, off, storage, in_backward=in_backward)
    grads = []
    with one_thread():
        for m, o in pairs:
            seen = []
            for i, b in enumerate(data):
                loss = loss_of(m, b)
                m.b.weight.requires_grad_(i != 1)
                loss.backward()
                seen.append(m.b.weight.grad is not None)
                m.b.weight.requires_grad_(True)
                o.step()
                o.zero_grad()
            grads.append(seen)
    assert grads[0] == grads[1] == [True, False, True, True]
    finish(pairs)


# ---- two optimizers sharing a module's weights ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("storage,off,in_backward", [("disk", "cpu", True), ("disk", "nvme", True),
                                                     ("cpu", "cpu", True), ("disk", "nvme", False)])
def test_two_optimizers_splitting_each_modules_weights(tmp_path, storage, off, in_backward):
    """Weights in one optimizer, biases in another: with in_backward=True both rewrite the same records from
    their own worker threads (disk_offload raised KeyError from DiskStore.end, the step partly applied). They
    take turns, and training equals the resident model's with the same two optimizers (several runs: the
    workers' timing varies)."""
    data = batches(MLP, 3)

    def split(model, where, **kw):
        named = list(model.named_parameters())
        return [build_opt("AdamW", [p for n, p in named if n.endswith(suffix)], tmp_path / where / suffix,
                          offload=off, **kw) for suffix in ("weight", "bias")]

    def run(model, opts):
        with one_thread():
            for b in data:
                loss_of(model, b).backward()
                for o in opts:
                    o.step()
                for o in opts:
                    o.zero_grad()
        for o in opts:
            o.close()

    ref = make_model()
    run(ref, split(ref, "ref"))
    for i in range(3):
        model = offload(make_model(), storage, tmp_path / str(i))
        run(model, split(model, str(i), in_backward=in_backward))
        remove_offload(model)
        assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_in_backward_second_backward_of_one_graph_says_in_backward(tmp_path, monkeypatch, storage):
    """loss.backward(retain_graph=True) then loss.backward() with in_backward=True: the second backward needs
    weights the first one's update is still rewriting. disk_offload blamed "a forward running during step()";
    the error must say what happened (every backward is one step) whatever the worker's progress. The worker
    is held inside its first rewrite until the second backward has failed (and waits for the updates it handed
    over, which then go on)."""
    from swapio.offload import weight_store
    from swapio.optim.worker import UpdateWorker
    store = weight_store.DiskStore if storage == "disk" else weight_store.HostStore
    release, original, second, original_idle = threading.Event(), store.end, threading.Event(), UpdateWorker.idle

    def held_end(self, *args, **kwargs):
        release.wait(30)
        return original(self, *args, **kwargs)

    def idle(self):
        if second.is_set():  # the failed backward waits for the updates it handed over: let them go on
            release.set()
        return original_idle(self)

    monkeypatch.setattr(store, "end", held_end)
    monkeypatch.setattr(UpdateWorker, "idle", idle)
    model = offload(make_model(), storage, tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", in_backward=True) as opt, one_thread():
        loss = loss_of(model, batches(MLP, 1)[0])
        loss.backward(retain_graph=True)
        second.set()
        try:
            with pytest.raises(RuntimeError, match=r"(?s)second backward.*in_backward=True every backward is one"):
                loss.backward()
        finally:
            release.set()
        opt.zero_grad()
    remove_offload(model)


@pytest.mark.parametrize("storage, activations", [("disk", None), ("cpu", None), ("cpu", "cpu")])
def test_in_backward_second_backward_after_the_updates_finished_says_in_backward(tmp_path, monkeypatch, storage,
                                                                                 activations):
    """BUG: the same second backward once the first one's updates have all been written: cpu_offload computing on
    the CPU saves the weights' host copies themselves for backward, so the second backward found them changed in
    place and gave autograd's "modified by an inplace operation", which blames the user's code, instead of the
    second backward. (The test above, where the update is held, got that one in about 1 run in 10 under load.)
    The same with activation offload on, which the weights' hooks handed the host copies to."""
    from swapio.offload import weight_store
    store = weight_store.DiskStore if storage == "disk" else weight_store.HostStore
    written, original = threading.Semaphore(0), store.end

    def counted_end(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            written.release()

    monkeypatch.setattr(store, "end", counted_end)
    model = offload(make_model(), storage, tmp_path)
    records = 4  # a, norm, b, c (tests/helpers/offload_training.py's MLP)
    with build_opt("AdamW", model.parameters(), tmp_path / "s", in_backward=True) as opt, one_thread():
        with offload_activations(to=activations) if activations else contextlib.nullcontext():
            loss = loss_of(model, batches(MLP, 1)[0])
        loss.backward(retain_graph=True)
        assert all(written.acquire(timeout=30) for _ in range(records))
        with pytest.raises(RuntimeError, match=r"(?s)second backward.*in_backward=True every backward is one"):
            loss.backward()
        opt.zero_grad()
    remove_offload(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gradient_hooks_of_a_cuda_model_may_keep_the_gradient(tmp_path):
    """On a CUDA model a gradient reaches the optimizer through a pinned staging buffer that the next gradient
    reuses: a hook that keeps the tensor it is given (no copy) must still hold its own gradient afterwards."""
    data = batches(MLP, 1)
    kept = []
    for m in (make_model().cuda(), offload(make_model(), "cpu", tmp_path, execution_device="cuda")):
        got = {}
        for n, p in m.named_parameters():
            p.register_hook(lambda g, n=n, got=got: got.__setitem__(n, g))
        with build_opt("AdamW", m.parameters(), tmp_path / "s") as opt, one_thread():
            x, y = data[0]
            torch.nn.functional.mse_loss(m(x.cuda()), y.cuda()).backward()
            opt.step()
        kept.append({n: g.cpu() for n, g in got.items()})
        if m.a.weight.device.type == "meta":
            remove_offload(m)
    assert kept[0].keys() == kept[1].keys()
    for n in kept[0]:
        assert torch.allclose(kept[1][n], kept[0][n], rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_value_is_refused_naming_a_hook_that_clamps_as_torch_does(tmp_path, dtype):
    """torch.nn.utils.clip_grad_value_ cannot reach an offloaded weight's gradient: its RuntimeError used to say
    "call opt.clip_grad_norm_", another clipping. It names the gradient hook that clamps each backward's gradient,
    which with one backward per step trains exactly as clip_grad_value_ on the resident model."""
    data = batches(MLP, 3)
    pairs = both(tmp_path, "cpu", dtype=dtype)
    (ref, ref_opt), (model, opt) = pairs
    with one_thread():
        loss_of(model, data[0]).backward()
        with pytest.raises(RuntimeError, match=r"clip_grad_value_.*register_hook") as info:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        assert "offloaded weight" in str(info.value)
        opt.zero_grad()
        for p in model.parameters():
            p.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        for b in data:
            loss_of(ref, b).backward()
            torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
            ref_opt.step()
            ref_opt.zero_grad()
            loss_of(model, b).backward()
            opt.step()
            opt.zero_grad()
    finish(pairs)


def test_grad_scaler_is_refused_naming_bf16_autocast(tmp_path):
    """torch.amp.GradScaler unscales every p.grad in step(): on an offloaded weight it is refused, naming what works
    (bf16 autocast, which needs no loss scaling), not opt.clip_grad_norm_."""
    model = offload(make_model(), "cpu", tmp_path)
    scaler = torch.amp.GradScaler("cpu")
    with build_opt("AdamW", model.parameters(), tmp_path / "s") as opt, one_thread():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, batches(MLP, 1)[0])
        scaler.scale(loss).backward()
        with pytest.raises(RuntimeError, match=r"GradScaler.*bfloat16") as info:
            scaler.step(opt)
        assert "offloaded weight" in str(info.value)
    remove_offload(model)
