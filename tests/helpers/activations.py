"""Small models and a reference run for the activation offload tests: every gradient of a run with
offload_activations must equal, bit for bit, the same run without it."""
import contextlib
import os
import threading

import torch


class Block(torch.nn.Module):
    """A transformer-like block whose saved tensors cover the cases: views sharing one storage (qkv split),
    transposed and strided views, dropout masks (bool), softmax outputs, LayerNorm statistics."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.drop = torch.nn.Dropout(0.1)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)  # three views of one storage
        v = v + q * k  # the mul saves two of them
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(y) * self.gate  # the buffer is saved by the mul
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class Stack(torch.nn.Module):
    def __init__(self, depth=3, dim=32, checkpoint=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))
        self.checkpoint = checkpoint  # None, or use_reentrant for torch.utils.checkpoint around each block

    def forward(self, x):
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint)
        return x


def make_stack(seed=0, **kw):
    torch.manual_seed(seed)
    return Stack(**kw)


def batch(b=2, t=8, dim=32, seed=1):
    return torch.randn(b, t, dim, generator=torch.Generator().manual_seed(seed))


def grads_of(model, x, ctx=None, backward_twice=False):
    """(loss, {name: grad}, grad of x) of one forward + backward, the forward inside ctx (if given), with the same
    random stream (dropout) whatever ctx is."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(123)
    with ctx if ctx is not None else contextlib.nullcontext():
        loss = model(x).square().mean()
    loss.backward(retain_graph=backward_twice)
    if backward_twice:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone()


def assert_same_grads(got, want):
    (gl, gg, gx), (wl, wg, wx) = got, want
    assert torch.equal(gl, wl), f"loss {gl.item()} != {wl.item()}"
    assert gg.keys() == wg.keys()
    for n in wg:
        assert torch.equal(gg[n], wg[n]), f"{n}: max diff {(gg[n] - wg[n]).abs().max()}"
    assert torch.equal(gx, wx)


def swap_files(directory):
    """The files in an offloader's swap directory other than its lock file."""
    if directory is None or not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if n != ".swapio-owner")


def hooks_installed():
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def settle(act):
    """Waits for every transfer of act's forwards and lets their sessions see it, as their next save or unpack
    would: after this, a change in place leaves the saved bytes as they were."""
    res = act._res
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if res.handle is not None:
        res.handle.wait()
    with res.lock:
        for session in list(res.sessions):
            session.poll()


class GatedWrites:
    """Holds act's writes unfinished, as the offload sees them, until release(): the window in which a change in
    place can meet the bytes on their way out. hold_waits=False: only polls see them unfinished, a wait for one
    returns once it is written (a disk whose writes are seen late, with no forward blocked on the gate)."""

    def __init__(self, act, monkeypatch, hold_waits=True):
        self.gate = threading.Event()
        handle, real = act._res.handle, act._res.handle.pwrite
        polled, waited = self.gate, (self.gate if hold_waits else _Open())

        class Gated:
            def __init__(self, inner):
                self.inner = inner

            def done(self):
                return polled.is_set() and self.inner.done()

            def wait(self, timeout=None):
                waited.wait()
                return self.inner.wait(timeout)

            def exception(self, timeout=None):
                waited.wait()
                return self.inner.exception(timeout)

        monkeypatch.setattr(handle, "pwrite", lambda *a, **k: Gated(real(*a, **k)))

    def release(self):
        self.gate.set()


class _Open:
    """A gate that never holds."""

    def wait(self, timeout=None):
        return True
