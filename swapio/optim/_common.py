"""Pieces shared by the RAM- and NVMe-resident optimizer states: per-step work items and the segment update."""
import importlib

import torch

FP32 = torch.float32
LOW_PRECISION = (torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOMENTS = ("exp_avg", "exp_avg_sq")


def load_ops():
    """swapio.ops (the CPU Adam kernel), imported on first use."""
    try:
        return importlib.import_module("swapio.ops")
    except ImportError as exc:
        raise ImportError("swapio.optim needs swapio.ops, the CPU Adam kernel; it was not built or failed to "
                          f"import ({exc}). Reinstall swapio (`pip install .`).") from exc


def kernel_supports_amsgrad(ops):
    import inspect
    try:
        names = inspect.signature(ops.adam_step_).parameters
    except (TypeError, ValueError):
        return False
    return "amsgrad" in names and "max_exp_avg_sq" in names


def needs_master(p):
    """An fp32 copy kept by the optimizer is needed unless the parameter itself is a contiguous fp32 CPU tensor
    (then the kernel updates it in place and it is its own master)."""
    return not (p.device.type == "cpu" and p.dtype == FP32 and p.is_contiguous())


def internal_fields(p, amsgrad):
    """The fp32 arrays the optimizer keeps for p, in their on-disk order."""
    fields = ("master",) if needs_master(p) else ()
    return fields + MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())


def exported_fields(p, amsgrad):
    """The fp32 arrays that state_dict()/save() carry for p: the moments, max_exp_avg_sq with amsgrad, and
    the master only for bf16/fp16 parameters (for fp32 parameters the master equals the parameter bit for bit)."""
    return MOMENTS + (("max_exp_avg_sq",) if amsgrad else ()) + (("master",) if p.dtype in LOW_PRECISION else ())


def group_hyper(group):
    """Keyword arguments for swapio.ops.adam_step_ from a param group (tensors become Python floats)."""
    def num(v):
        return float(v.item()) if isinstance(v, torch.Tensor) else float(v)
    beta1, beta2 = group["betas"]
    return {"lr": num(group["lr"]), "beta1": num(beta1), "beta2": num(beta2), "eps": num(group["eps"]),
            "weight_decay": num(group["weight_decay"]), "adamw": bool(group.get("decoupled_weight_decay", False)),
            "maximize": bool(group.get("maximize", False))}


class Work:
    """One parameter that has a gradient in this step."""

    __slots__ = ("p", "numel", "grad", "dst", "tmp", "src", "step", "hyper", "amsgrad", "new", "cuda", "master",
                 "low")

    def __init__(self, p, step, hyper, amsgrad, new):
        self.p, self.numel, self.step, self.hyper, self.amsgrad, self.new = p, p.numel(), step, hyper, amsgrad, new
        self.cuda = p.device.type == "cuda"
        self.master = needs_master(p)
        self.low = p.dtype in LOW_PRECISION
        g = p.grad.detach()
        self.grad = g.view(-1) if g.is_contiguous() else g.contiguous().view(-1)
        data = p.detach()
        if data.is_contiguous():
            self.dst, self.tmp, self.src = data.view(-1), None, data.view(-1)
        else:  # written into a contiguous temporary, copied into the parameter after its last segment
            self.tmp = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            self.dst = self.tmp.view(-1)
            self.src = data.contiguous().view(-1) if new else None

    def finish(self):
        if self.tmp is not None:
            self.p.detach().copy_(self.tmp)


def init_segment(w, a, b, fields):
    """First step of a parameter: zero moments, master = the parameter's value."""
    for name, view in fields.items():
        if name == "master":
            view.copy_(w.src[a:b])
        else:
            view.zero_()


def run_segment(ops, threads, w, a, b, fields, stage_g, stage_o):
    """Adam on elements [a, b) of w.p. fields: fp32 CPU views of the state for those elements. stage_g/stage_o:
    pinned uint8 buffers (>= 4*(b-a) bytes) for parameters on a GPU, else None. For a GPU parameter the
    host-to-device copy is queued (non_blocking) on the current stream; the caller synchronises."""
    n = b - a
    if w.cuda:
        grad = stage_g[:n * w.grad.element_size()].view(w.grad.dtype)
        grad.copy_(w.grad[a:b])
    else:
        grad = w.grad[a:b]
    master = fields.get("master")
    out = None
    if master is None:
        param = w.dst[a:b]
    else:
        param = master
        if w.low:
            out = stage_o[:n * w.p.element_size()].view(w.p.dtype) if w.cuda else w.dst[a:b]
    extra = {}
    if w.amsgrad:
        extra = {"amsgrad": True, "max_exp_avg_sq": fields["max_exp_avg_sq"]}
    ops.adam_step_(param, grad, fields["exp_avg"], fields["exp_avg_sq"], step=w.step, param_out=out,
                   threads=threads, **w.hyper, **extra)
    if master is not None:
        if w.cuda:
            src = out
            if src is None:  # fp32 on the GPU: stage the master in pinned memory for an async copy
                src = stage_o[:n * 4].view(FP32)
                src.copy_(master)
            w.dst[a:b].copy_(src, non_blocking=True)
        elif not w.low:  # fp32, non-contiguous CPU parameter
            w.dst[a:b].copy_(master)
    if b == w.numel:
        w.finish()
