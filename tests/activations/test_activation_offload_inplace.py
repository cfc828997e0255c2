"""Saved tensors and in-place changes under activation offload. Saved-tensor hooks turn autograd's own check off,
so the offload must keep it: what autograd accepts without offload runs bit-equal with it, and a saved tensor
changed in place either raises autograd's error (as without offload) or comes back as it was saved, never with
the changed bytes."""
import contextlib

import pytest
import torch

from helpers.activations import GatedWrites, settle, swap_files
from swapio.offload import offload_activations

INPLACE = r"modified by an inplace operation"


def offloader(tmp_path, to, **kw):
    if to == "cpu":
        return offload_activations(to="cpu", **kw)
    kw.setdefault("min_bytes", 0)
    return offload_activations(to="nvme", swap_dir=tmp_path, **kw)


# ---- what autograd accepts: no new error, the same gradients -------------------------------------------------------

class ScaleInPlace(torch.autograd.Function):
    """Changes its input in place, marks it dirty and saves it (the changed one) for backward."""

    @staticmethod
    def forward(ctx, x, w):
        x.mul_(w)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, w)
        return x

    @staticmethod
    def backward(ctx, g):
        y, w = ctx.saved_tensors
        return g * w, (g * y / w).sum(0)


class Res(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.c2, self.b2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        out = torch.relu_(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        out += x
        return torch.relu_(out)


def accepted_inplace_step(ctx):
    """In-place patterns autograd accepts: ReLU(inplace) after BatchNorm, a residual `+=`, three forwards of one
    BatchNorm model before one backward, in-place sigmoid/tanh/dropout, a dirty custom Function; then an optimizer
    step, zero_grad and a second iteration. Returns every gradient, loss and buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(inplace=True), Res(), Res(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 8))
    w = torch.rand(4, requires_grad=True)
    opt = torch.optim.SGD([*model.parameters(), w], lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    out = []
    for step in range(2):
        torch.manual_seed(step)
        with ctx(model):
            h = sum(model(x * (i + 1)) for i in range(3))
            h.mul_(0.5)
            h = h.sigmoid_()  # saves its result, which the next op saves again
            g = h @ h.t()
            g = torch.nn.functional.dropout(g, 0.3, training=True, inplace=True)
            g.tanh_()
            y = ScaleInPlace.apply(g * 1, w + 1)
            loss = (y.sin() * g).sum()
        loss.backward()
        out += [loss.detach(), w.grad.clone(), *(p.grad.clone() for p in model.parameters()),
                *(b.clone() for b in model.buffers())]
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("to,staging_bytes,with_model", [
    ("nvme", 0, True), ("nvme", 64 << 20, False), ("cpu", None, False)],
    ids=["nvme-no-staging-model", "nvme-staging", "cpu"])
def test_inplace_patterns_autograd_accepts_run_bit_equal(tmp_path, monkeypatch, to, staging_bytes, with_model):
    want = accepted_inplace_step(lambda model: contextlib.nullcontext())
    kw = {} if staging_bytes is None else {"staging_bytes": staging_bytes}
    acts = []

    def ctx(model):
        if not acts:
            acts.append(offloader(tmp_path, to, model=model if with_model else None, **kw))
            if to == "nvme" and staging_bytes:
                GatedWrites(acts[0], monkeypatch, hold_waits=False)  # writes seen finished only when waited for
        return acts[0]
    got = accepted_inplace_step(ctx)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert acts[0].stats()["tensors"] > 0 or to == "cpu"
    acts[0].close()
    assert swap_files(tmp_path) == []


# ---- tensors the offload leaves where they are keep autograd's check ------------------------------------------------

def change_kept_tensor(ctx, kind):
    """A forward whose saved tensor of `kind` the offload leaves in place, changed in place before backward."""
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 16)
    m.register_buffer("scale", torch.rand(16))
    a = torch.randn(8, 16, requires_grad=True)
    with ctx(m):
        b = a * 1
        loss = (m(b).sin() * m.scale).sum() + (b * b).sum()
    with torch.no_grad():
        {"activation": b, "parameter": m.weight, "model-buffer": m.scale}[kind].mul_(2)
    loss.backward()


@pytest.mark.parametrize("to,kind,kw", [
    ("cpu", "activation", {}),  # to="cpu" leaves CPU tensors where they are
    ("nvme", "activation", {"min_bytes": 1 << 20}),  # below min_bytes
    ("nvme", "parameter", {}),
    ("nvme", "model-buffer", {"model": True}),
], ids=["cpu-mode", "below-min-bytes", "parameter", "model-buffer"])
def test_a_saved_tensor_left_in_place_and_changed_raises_as_without_offload(tmp_path, to, kind, kw):
    with pytest.raises(RuntimeError, match=INPLACE):  # the reference: autograd without offload
        change_kept_tensor(lambda m: contextlib.nullcontext(), kind)
    acts = []

    def ctx(m):
        acts.append(offloader(tmp_path, to, **{**kw, "model": m if kw.get("model") else None}))
        return acts[-1]
    with pytest.raises(RuntimeError, match=INPLACE + r".*is at version \d+; expected version \d+ instead"):
        change_kept_tensor(ctx, kind)
    acts[0].close()
    assert swap_files(tmp_path) == []


def test_a_tensor_left_in_place_and_not_changed_comes_back_itself(tmp_path):
    """(Left in place, the saved tensor is the tensor itself: no copy, the same memory.)"""
    act = offload_activations(to="cpu")
    seen = []

    class Peek(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(ctx.saved_tensors[0].data_ptr())
            return g * 2
    a = torch.randn(4, requires_grad=True)
    b = a * 1
    with act:
        loss = Peek.apply(b).sum()
    loss.backward()
    assert seen == [b.data_ptr()] and torch.equal(a.grad, torch.full((4,), 2.0))
    act.close()


# ---- a change after the save was written comes back as saved, however often it is unpacked -------------------------

def sin_times(act, a):
    """b saved twice: by sin (its node runs last in backward) and by the product (runs first)."""
    with act:
        b = a * 1
        c = b.sin()
        loss = (c * b).sum()
    return b, c, loss


def sin_times_grad(a):
    a = a.detach()
    return a.cos() * a + a.sin()


@pytest.mark.parametrize("staging_bytes", [0, 64 << 20], ids=["on-disk", "kept-in-ram"])
def test_a_tensor_changed_between_two_backwards_comes_back_as_saved_in_the_second(tmp_path, staging_bytes):
    """(The first backward found it in RAM, the tensor's own memory: the second must not use that memory again.)"""
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=staging_bytes)
    a = torch.randn(256, 256, requires_grad=True)
    b, c, loss = sin_times(act, a)
    settle(act)
    loss.backward(retain_graph=True)
    assert torch.equal(a.grad, sin_times_grad(a))
    a.grad = None
    b.add_(1)
    loss.backward()
    assert torch.equal(a.grad, sin_times_grad(a))
    del b, c, loss
    act.close()
    assert swap_files(tmp_path) == []


@pytest.mark.parametrize("staging_bytes", [0, 64 << 20], ids=["on-disk", "kept-in-ram"])
def test_a_tensor_changed_during_backward_between_its_unpacks_comes_back_as_saved(tmp_path, staging_bytes):
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=staging_bytes)
    a = torch.randn(256, 256, requires_grad=True)
    b, c, loss = sin_times(act, a)
    settle(act)

    def change_b(grad):  # after the product's node unpacked b, before sin's node does
        b.add_(1)
        return grad
    c.register_hook(change_b)
    loss.backward()
    assert torch.equal(a.grad, sin_times_grad(a))
    del b, c, loss
    act.close()


def test_a_tensor_changed_during_backward_while_its_write_is_in_flight_fails_loudly(tmp_path, monkeypatch):
    """The first unpack found it in RAM with its write still in flight; changed then, what the disk got may be torn:
    the second unpack raises, as autograd does without offload."""
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=64 << 20)
    writes = GatedWrites(act, monkeypatch)
    a = torch.randn(256, 256, requires_grad=True)
    b, c, loss = sin_times(act, a)

    def change_b(grad):
        b.add_(1)
        writes.release()
        return grad
    c.register_hook(change_b)
    with pytest.raises(RuntimeError, match=INPLACE + r".*\[256, 256\].*changed in place while swapio"):
        loss.backward()
    del b, c, loss
    b, c, loss = sin_times(act, a)  # the offload goes on working
    loss.backward()
    assert torch.equal(a.grad, sin_times_grad(a))
    del b, c, loss
    act.close()
    assert swap_files(tmp_path) == []


# ---- the same under the hooks of training offloaded weights ---------------------------------------------------------

class ChangesWhatItSaved(torch.nn.Linear):
    """Inside an offloaded module's forward (where swapio's hooks for its weights are on): saves its output for
    sin, then changes that output in place."""

    def forward(self, x):
        h = super().forward(x)
        y = h.sin()
        h.add_(1)
        return y


@pytest.mark.parametrize("with_activation_offload", [False, True], ids=["weights-only", "with-activations"])
def test_a_saved_tensor_changed_in_an_offloaded_module_raises_as_without_offload(tmp_path, with_activation_offload):
    from helpers.offload_training import build_opt
    from swapio.offload import disk_offload, remove_offload

    def step(model, ctx):
        with ctx:
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum()
        loss.backward()
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=INPLACE):  # the reference: resident, no hooks
        step(torch.nn.Sequential(ChangesWhatItSaved(8, 16)), contextlib.nullcontext())
    model = disk_offload(torch.nn.Sequential(ChangesWhatItSaved(8, 16)), str(tmp_path / "od"))
    opt = build_opt("AdamW", list(model.parameters()), tmp_path)  # trains the offloaded weights
    act = offload_activations(to="cpu") if with_activation_offload else contextlib.nullcontext()
    with pytest.raises(RuntimeError, match=INPLACE + r".*is at version \d+; expected version \d+ instead"):
        step(model, act)
    del opt
    remove_offload(model)
