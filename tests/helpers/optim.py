"""Helpers for the swapio.optim tests: reference runs against torch.optim.Adam/AdamW on fp32 masters."""
import pytest
import torch

import swapio.optim as so

TOL = 1e-5  # max relative difference of the fp32 master weights (max |ours - torch| / max |torch| per tensor)
SMALL_BUFFERS = {"buffer_bytes": 3 * (64 << 10), "buffer_count": 3}  # 64 KiB slots: params span chunks


def rel_diff(ours, ref):
    ours, ref = ours.detach().float().cpu(), ref.detach().float().cpu()
    scale = ref.abs().max().clamp_min(1e-30)
    return ((ours - ref).abs().max() / scale).item()


def masters(opt, params):
    """Our fp32 master weights: state_dict's "master" for low-precision params, else the params themselves."""
    sd = opt.state_dict()
    out = []
    for i, p in enumerate(params):
        st = sd["state"].get(i, {})
        out.append(st["master"] if "master" in st else p.detach().float().cpu())
    return out


def ref_copy(params):
    """fp32 CPU leaf copies of params, the reference's master weights."""
    return [p.detach().float().cpu().clone().requires_grad_(True) for p in params]


def group_spec(params, split, lr2=3e-3, wd2=0.0, betas2=(0.8, 0.99), eps2=1e-6):
    """Two param groups with different hyperparameters (the second overrides lr, betas, eps, weight decay)."""
    return [{"params": params[:split]},
            {"params": params[split:], "lr": lr2, "betas": betas2, "eps": eps2, "weight_decay": wd2}]


def make_opts(cls_name, ours_params, ref_params, split, mode, swap_dir, lr=1e-3, wd=0.05, ours_kwargs=None,
              **common):
    ours_cls = getattr(so, "Offload" + cls_name)
    ref_cls = getattr(torch.optim, cls_name)
    kwargs = dict(ours_kwargs or {})
    if mode == "nvme":
        kwargs.setdefault("swap_dir", swap_dir)
    ours = ours_cls(group_spec(ours_params, split), lr=lr, weight_decay=wd, offload=mode, **common, **kwargs)
    ref = ref_cls(group_spec(ref_params, split), lr=lr, weight_decay=wd, foreach=False, **common)
    return ours, ref


def feed(ours_params, ref_params, grads):
    for p, q, g in zip(ours_params, ref_params, grads):
        if g is None:
            p.grad = q.grad = None
        else:
            p.grad = g.to(device=p.device, dtype=p.dtype)
            q.grad = p.grad.detach().float().cpu()  # the reference sees exactly the gradient we see


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids oversubscribing the shared 2-core machines (the kernel follows it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def stepped_cpu_adamw(numel):
    """A cpu-mode OffloadAdamW over one parameter of `numel` ones, stepped once (so that it has state to save)."""
    p = torch.ones(numel, requires_grad=True)
    opt = so.OffloadAdamW([p], lr=1e-2, offload="cpu")
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt
