"""Tensor-level entry points of swapio's CPU Adam kernel.

``adam_step_`` runs one Adam/AdamW step in place on flat CPU tensors with the native kernel (AVX-512, AVX2
or portable scalar code, chosen at run time; ``SWAPIO_CPU_CAPABILITY=scalar|avx2|avx512`` forces a level).
``adam_step_reference_`` is the same step in plain torch ops, for any device, and is what the kernel is
tested against (together with ``torch.optim.AdamW``/``Adam`` themselves).

Numerics: the update formula and its float32 operation order are those of ``torch.optim.Adam``/``AdamW``
with ``foreach=False, fused=False``. The kernel differs from torch only where torch's CPU ``sqrt`` is not
correctly rounded (it is off by up to 0.75 ulp; the kernel's is exact), so parameters agree to float32
rounding (about 1e-7 relative per step).

amsgrad is supported (pass ``amsgrad=True`` and a ``max_exp_avg_sq`` buffer).
"""
import math
import numbers
import warnings

import torch

from . import _C
from ._errors import SwapioWarning

__all__ = ["adam_step_", "adam_step_reference_", "cpu_capability", "cpu_capabilities"]

_CODES = _C.ADAM_DTYPE_CODES
_GRAD_DTYPES = {torch.float32: _CODES["float32"], torch.bfloat16: _CODES["bfloat16"],
                torch.float16: _CODES["float16"]}
_OUT_DTYPES = _GRAD_DTYPES
_LEVELS = ("scalar", "avx2", "avx512")
_warned_capability = False


def cpu_capability():
    """SIMD level the Adam kernel uses: ``"avx512"``, ``"avx2"`` or ``"scalar"``.

    When ``SWAPIO_CPU_CAPABILITY`` names a level this CPU lacks (or no known level), the best available
    level is used instead and a ``SwapioWarning`` says so (once per process).
    """
    global _warned_capability
    info = _C.adam_capability_info()
    if not info["request_honored"] and not _warned_capability:
        _warned_capability = True
        warnings.warn(
            f"SWAPIO_CPU_CAPABILITY={info['requested']!r} cannot be used here (levels supported: "
            f"{', '.join(info['supported'])}); the Adam kernel uses {info['active']!r}",
            SwapioWarning, stacklevel=2)
    return info["active"]


def cpu_capabilities():
    """SIMD levels this CPU supports, lowest first (each can be passed as ``capability=``)."""
    return list(_C.adam_capability_info()["supported"])


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _scalar(name, value):
    """A Python float from a number or a one-element tensor (lr schedulers may hand either)."""
    if type(value) is float or type(value) is int:  # the common case, without the slow ABC checks below
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _step(step):
    if type(step) is int and step >= 1:
        return step
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"step must be a number or a one-element tensor, got shape {tuple(step.shape)}")
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not math.isfinite(step) or step != int(step):
        raise ValueError(f"step must be a whole number, got {step}")
    step = int(step)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step being taken, counting from 1), got {step}")
    return step


def _hyper(step, lr, beta1, beta2, eps, weight_decay):
    step = _step(step)
    lr = _scalar("lr", lr)
    beta1 = _scalar("beta1", beta1)
    beta2 = _scalar("beta2", beta2)
    eps = _scalar("eps", eps)
    weight_decay = _scalar("weight_decay", weight_decay)
    if not (0.0 <= lr < math.inf):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not (0.0 <= eps < math.inf):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not (0.0 <= weight_decay < math.inf):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    return step, lr, beta1, beta2, eps, weight_decay


def adam_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, adamw=True,
               maximize=False, amsgrad=False, max_exp_avg_sq=None, param_out=None, threads=None,
               capability=None):
    """One Adam (``adamw=False``: L2 weight decay) or AdamW step, in place, with the native CPU kernel.

    param, exp_avg, exp_avg_sq (and max_exp_avg_sq with ``amsgrad``): contiguous fp32 CPU tensors of one
    numel. grad: contiguous CPU tensor of that numel, fp32, bf16 or fp16 (widened in registers).
    param_out: None, or a contiguous CPU bf16/fp16/fp32 tensor of that numel that receives the updated
    param rounded to nearest even (equal to ``param.to(param_out.dtype)``) in the same pass.
    step: the step being taken, counting from 1 (torch's ``state["step"]`` after its increment).
    lr and the other hyperparameters: numbers or one-element tensors.
    threads: threads to use (None or 0: ``torch.get_num_threads()``).
    capability: None (the active level) or ``"scalar"``/``"avx2"``/``"avx512"`` (ValueError if missing).
    Returns ``param``. Raises TypeError for non-tensors, ValueError for bad devices, layouts, dtypes,
    sizes or hyperparameters.
    """
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(name, t)
    extra = []
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs max_exp_avg_sq")
        extra.append(("max_exp_avg_sq", _check_tensor("max_exp_avg_sq", max_exp_avg_sq)))
    if param_out is not None:
        extra.append(("param_out", _check_tensor("param_out", param_out)))
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), *extra):
        if t.layout is not torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got {t.layout}")
        if not t.is_cpu:
            raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param has {n}")
    fp32 = [("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if amsgrad:
        fp32.append(("max_exp_avg_sq", max_exp_avg_sq))
    for name, t in fp32:
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    if param_out is not None and param_out.dtype not in _OUT_DTYPES:
        raise ValueError(f"param_out must be bfloat16, float16 or float32, got {param_out.dtype}")
    step, lr, beta1, beta2, eps, weight_decay = _hyper(step, lr, beta1, beta2, eps, weight_decay)
    if threads is None or threads == 0:
        threads = torch.get_num_threads()
    elif isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    elif threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    if capability is None:
        capability = ""
    elif not isinstance(capability, str):
        raise TypeError(f"capability must be a str or None, got {type(capability).__name__}")
    elif capability.lower() not in _LEVELS:
        raise ValueError(f"capability must be one of {_LEVELS}, got {capability!r}")
    if n == 0:
        return param
    _C.adam_step(
        param.data_ptr(), grad.data_ptr(), _GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=bool(adamw),
        maximize=bool(maximize), amsgrad=bool(amsgrad),
        max_exp_avg_sq=max_exp_avg_sq.data_ptr() if amsgrad else 0,
        param_out=param_out.data_ptr() if param_out is not None else 0,
        out_dtype=_OUT_DTYPES[param_out.dtype] if param_out is not None else _CODES["none"],
        threads=int(min(threads, 1024)), capability=capability)
    return param


@torch.no_grad()
def adam_step_reference_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
                         adamw=True, maximize=False, amsgrad=False, max_exp_avg_sq=None, param_out=None,
                         threads=None, capability=None):
    """``adam_step_`` in plain torch ops (torch's ``_single_tensor_adam``, op for op), on any device.

    The state tensors and param share a floating dtype (normally fp32); grad may be of any floating dtype
    and is converted to param's. ``threads`` and ``capability`` are accepted for signature compatibility
    and ignored. Returns ``param``.
    """
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(name, t)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sq")
    if param_out is not None:
        _check_tensor("param_out", param_out)
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("max_exp_avg_sq", max_exp_avg_sq if amsgrad else None), ("param_out", param_out)):
        if t is not None and t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param has {n}")
    step, lr, beta1, beta2, eps, weight_decay = _hyper(step, lr, beta1, beta2, eps, weight_decay)

    g = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    if g.shape != param.shape:
        g = g.reshape(param.shape)
    if maximize:
        g = -g
    if weight_decay != 0:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step = float(step)  # torch keeps the step in a float tensor
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    if amsgrad:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_out is not None:
        param_out.copy_(param.reshape(param_out.shape))
    return param
