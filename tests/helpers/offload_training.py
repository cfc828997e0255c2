"""Helpers for tests/test_offload_train_*.py: tiny models trained offloaded (swapio.offload + swapio.optim) and
resident with the same optimizer and options, for bit-exact comparisons.

The resident reference is an independent run: the same model, the same swapio optimizer class and options, the
plain torch training loop (loss.backward(); step(); zero_grad()). One exception, by design of swapio: an
offloaded weight's gradients of several backward passes are summed in fp32, while torch sums a bf16
parameter's .grad in bf16; for bf16 weights with accumulation the reference therefore sums p.grad.float() itself
and steps with the optimizer's _step_params seam (the update is the same kernel, fed the same fp32 sum).
"""
import errno
import os

import torch

from helpers.offload import one_thread  # noqa: F401 - the tests import it from here too
from swapio.core.handle import AioHandle
from swapio.offload import cpu_offload, disk_offload, remove_offload
from swapio.optim import OffloadAdafactor, OffloadAdam, OffloadAdamW, OffloadLion

IN, HID, OUT = 8, 16, 4
BATCH = 5


class MLP(torch.nn.Module):
    """Three Linear layers and a LayerNorm: each a separate offloaded record."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, HID)
        self.norm = torch.nn.LayerNorm(HID)
        self.b = torch.nn.Linear(HID, HID)
        self.c = torch.nn.Linear(HID, OUT)

    def forward(self, x):
        x = x.to(self.a.weight.dtype)  # an offloaded model's placeholder has the weight's dtype too
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(self.norm(h)))
        return self.c(h)


class Tied(torch.nn.Module):
    """Embedding tied to the output head (as GPT-2's wte / lm_head), with a layer between."""

    VOCAB, DIM = 32, 12

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(self.VOCAB, self.DIM)
        self.mid = torch.nn.Linear(self.DIM, self.DIM)
        self.head = torch.nn.Linear(self.DIM, self.VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))




def make_model(cls=MLP, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return cls().to(dtype)


def meta_model(cls=MLP, dtype=torch.float32):
    with torch.device("meta"):
        return cls().to(dtype)


def batches(cls, n, seed=1):
    """n reproducible (input, target) pairs for cls."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if cls is Tied:
            ids = torch.randint(0, Tied.VOCAB, (BATCH, 6), generator=g)
            out.append((ids, torch.randint(0, Tied.VOCAB, (BATCH, 6), generator=g)))
        else:
            out.append((torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)))
    return out


def loss_of(model, batch):
    x, y = batch
    out = model(x)
    if out.dtype != torch.float32:
        out = out.float()
    if y.dtype == torch.long:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return torch.nn.functional.mse_loss(out, y)


OPTIMIZERS = {"AdamW": OffloadAdamW, "Adam": OffloadAdam, "Lion": OffloadLion, "Adafactor": OffloadAdafactor}


def build_opt(name, params, tmp, **kw):
    kw = dict(kw)
    kw.setdefault("lr", 1e-2)
    if name != "Lion":
        kw.setdefault("weight_decay", 0.01)
    else:
        kw.setdefault("weight_decay", 0.1)
        kw["lr"] = kw["lr"] / 10
    if kw.get("offload") == "nvme" and "swap_dir" not in kw:
        kw["swap_dir"] = str(tmp)
        os.makedirs(kw["swap_dir"], exist_ok=True)
    return OPTIMIZERS[name](params, **kw)


def save_checkpoint_file(model, path):
    """The model's weights as a safetensors file (ties stored once, as save_pretrained does)."""
    from safetensors.torch import save_model
    save_model(model, str(path))
    return str(path)


def offload(model, storage, tmp, cls=MLP, dtype=torch.float32, **kw):
    """Offloads `model` (a resident copy of the reference) with `storage`: "disk" (offload_dir), "ckpt" (a model
    built on meta read from a safetensors checkpoint of `model`, with an offload_dir), "cpu" (cpu_offload)."""
    tmp = str(tmp)
    if storage == "disk":
        return disk_offload(model, os.path.join(tmp, "od"), **kw)
    if storage == "ckpt":
        ckpt = save_checkpoint_file(model, os.path.join(tmp, "model.safetensors"))
        return disk_offload(meta_model(cls, dtype), checkpoint=ckpt, offload_dir=os.path.join(tmp, "od"), **kw)
    if storage == "cpu":
        return cpu_offload(model, **kw)
    raise AssertionError(storage)


def train(model, opt, data, micro=1, fp32_accumulate=False):
    """The usual loop: for each step, `micro` backward passes, step(), zero_grad(). Returns the losses.
    fp32_accumulate (resident reference only): sums p.grad.float() between micro-batches and steps through
    _step_params, as swapio sums offloaded gradients."""
    losses = []
    params = [p for g in opt.param_groups for p in g["params"]]
    with one_thread():
        for k in range(0, len(data), micro):
            acc = {}
            for batch in data[k:k + micro]:
                loss = loss_of(model, batch)
                loss.backward()
                losses.append(loss.detach().clone())
                if fp32_accumulate:
                    for p in params:
                        if p.grad is not None:
                            acc[p] = p.grad.float().clone() if p not in acc else acc[p].add_(p.grad.float())
                            p.grad = None
            if fp32_accumulate:
                opt._step_params(None, acc.get)
            else:
                opt.step()
            opt.zero_grad()
    return losses


def assert_trains_as_resident(model, ref, data, tmp, loss=loss_of):
    """Trains the offloaded `model` and its resident copy `ref` side by side (AdamW, offload="cpu"), one step a
    batch, checking each loss and, after remove_offload(model), the weights."""
    ref_opt = build_opt("AdamW", ref.parameters(), os.path.join(str(tmp), "ref-swap"), offload="cpu")
    opt = build_opt("AdamW", model.parameters(), os.path.join(str(tmp), "swap"), offload="cpu")
    with one_thread():
        for b in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                m.loss = loss(m, b)
                m.loss.backward()
                o.step()
                o.zero_grad()
            assert torch.equal(model.loss, ref.loss)
    ref_opt.close()
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def clipped_norms(model, opt, data, clip, micro=1):
    """Trains on data, micro batches a step, calling clip(model, opt) before each step; its results, in order."""
    norms = []
    with one_thread():
        for k in range(0, len(data), micro):
            for b in data[k:k + micro]:
                loss_of(model, b).backward()
            norms.append(clip(model, opt))
            opt.step()
            opt.zero_grad()
    return norms


def weights(model):
    """{name: a copy} of a resident model's parameters (ties under each name)."""
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def assert_same_weights(got, want):
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype, n
        assert torch.equal(got[n], want[n]), f"{n}: max diff {(got[n].float() - want[n].float()).abs().max()}"


def assert_same_losses(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"loss {i}: {g.item()} != {w.item()}"


def resident_run(cls, dtype, opt_name, data, tmp, micro=1, opt_kw=None):
    model = make_model(cls, dtype)
    opt_kw = dict(opt_kw or {})
    opt_kw.pop("in_backward", None)  # a resident model has no gradient hooks: the plain step
    fp32_acc = dtype != torch.float32 and micro > 1
    os.makedirs(os.path.join(str(tmp), "ref-swap"), exist_ok=True)
    with build_opt(opt_name, model.parameters(), os.path.join(str(tmp), "ref-swap"), **opt_kw) as opt:
        losses = train(model, opt, data, micro, fp32_accumulate=fp32_acc)
    return losses, weights(model)


# ---- failing writes -----------------------------------------------------------------------------------------
class FailedWrite:
    """What AioHandle.pwrite returns for a write the disk refused (ENOSPC): every wait() raises, as swapio's
    Future does."""

    def __init__(self, path):
        self.path = path

    def _error(self):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def wait(self, timeout=None):
        raise self._error()

    result = wait

    def exception(self, timeout=None):
        return self._error()

    def done(self):
        return True


def fail_nth_write(monkeypatch, where, n, how, count=1):
    """From the n-th pwrite to a path containing `where` on, `count` of them (None: all) fail: how="future" (a
    failed future: the disk refused it) or "raise". Returns the function that restores AioHandle.pwrite."""
    orig = AioHandle.pwrite
    calls = [0]

    def pwrite(self, t, path, offset=0, **kw):
        if where in os.fspath(path):
            calls[0] += 1
            if calls[0] >= n and (count is None or calls[0] < n + count):
                if how == "raise":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
                return FailedWrite(os.fspath(path))
        return orig(self, t, path, offset, **kw)

    monkeypatch.setattr(AioHandle, "pwrite", pwrite)
    return lambda: monkeypatch.setattr(AioHandle, "pwrite", orig)


def reference(tmp, data, storage="disk", **kw):
    """(losses, {name: final value}) of a model offloaded with `storage` and trained on data without faults."""
    model = offload(make_model(), storage, tmp)
    opt = build_opt("AdamW", model.parameters(), os.path.join(tmp, "s"), **kw)
    losses = train(model, opt, data)
    values = {n: opt.param_value(p).clone() for n, p in model.named_parameters()}
    opt.close()
    remove_offload(model)
    return losses, values


def started(tmp, data, storage="disk", **kw):
    """A model offloaded with `storage` trained on data[:2], its optimizer saved to tmp/saved."""
    model = offload(make_model(), storage, tmp)
    opt = build_opt("AdamW", model.parameters(), os.path.join(tmp, "s"), **kw)
    train(model, opt, data[:2])
    opt.save(os.path.join(tmp, "saved"))
    return model, opt


def assert_goes_on(model, opt, tmp, data, want):
    """load() of the last checkpoint, then the run continues exactly like the uninterrupted one."""
    opt.zero_grad()
    opt.load(os.path.join(tmp, "saved"))
    losses = train(model, opt, data[2:])
    assert all(torch.equal(a, b) for a, b in zip(losses, want[0][2:]))
    for n, p in model.named_parameters():
        assert torch.equal(opt.param_value(p), want[1][n]), n


# ---- a second process for resume tests ----------------------------------------------------------------------
def child(spec):
    """Runs in a new process (a child of the fork server): spec is a dict (see test_offload_train_resume.py).
    phase "first": offloads a fresh model, trains spec["steps"] steps, saves the optimizer to spec["save"], then
    trains spec["extra"] more steps (the storage moves past the checkpoint) and dies without any cleanup.
    phase "resume": builds the model on meta, offloads it from spec["od"] (and spec["ckpt"]), a new optimizer,
    load(spec["save"]), trains the steps from spec["start"] to spec["end"], then writes the weights to spec["out"]."""
    torch.set_num_threads(1)
    dtype = getattr(torch, spec["dtype"])
    data = batches(MLP, spec["total"])
    kw = dict(offload=spec["offload"], state_dtype=spec["state_dtype"], in_backward=spec["in_backward"])
    swap = spec["swap"]
    os.makedirs(swap, exist_ok=True)
    if spec["phase"] == "first":
        model = make_model(MLP, dtype)
        if spec.get("ckpt"):  # written by the test from the same model
            model = disk_offload(meta_model(MLP, dtype), checkpoint=spec["ckpt"], offload_dir=spec["od"])
        else:
            model = disk_offload(model, spec["od"])
        opt = build_opt("AdamW", model.parameters(), swap, swap_dir=swap, **kw)
        train(model, opt, data[:spec["steps"]])
        opt.save(spec["save"])
        train(model, opt, data[spec["steps"]:spec["steps"] + spec["extra"]])
        os._exit(0)  # as a crash would: no close, no remove_offload
    if spec.get("ckpt"):
        model = disk_offload(meta_model(MLP, dtype), checkpoint=spec["ckpt"], offload_dir=spec["od"])
    else:
        model = disk_offload(meta_model(MLP, dtype), offload_dir=spec["od"])
    opt = build_opt("AdamW", model.parameters(), swap, swap_dir=swap, **kw)
    opt.load(spec["save"])
    losses = train(model, opt, data[spec["start"]:spec["end"]])
    opt.close()
    remove_offload(model)
    torch.save({"weights": weights(model), "losses": losses}, spec["out"])

class WithHead(torch.nn.Module):
    """A module of the user's own holding an offloaded model as its backbone, with a new resident head (seeded)."""

    def __init__(self, backbone, features):
        super().__init__()
        self.backbone = backbone
        torch.manual_seed(9)
        self.head = torch.nn.Linear(*features)

    def forward(self, x):
        return self.head(self.backbone(x))
