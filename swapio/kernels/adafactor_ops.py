"""Tensor-level Adafactor step (torch.optim.Adafactor's algorithm): the native kernel and its plain-torch
reference, re-exported by swapio.ops.

A step needs the whole parameter: its norm, the row and column means of the squared gradient and the norm of the
update are reductions over all of it. A parameter of two or more dimensions keeps its second moment factored over
its last two dimensions (row_var shaped like the parameter with its last dimension 1, col_var with the one before
it 1), as torch does; one of fewer dimensions keeps the full `variance`. The tensors here are flat views (any
shape of the right numel); `shape` is the parameter's.

Numerics: the formula and its float32 order are torch's _single_tensor_adafactor, but for two places where the
kernel computes in its own order: the sums of squares (16 lanes, fixed blocks, added in double), and the update
of a factored parameter, g / max(sqrt(row_var / max(mean, eps1)) * sqrt(col_var), sqrt(e)) with the square roots
taken per row and per column and e = float32(eps1 * eps1) (torch: rsqrt(max(row_var * col_var / max(mean, eps1),
e)) * g, per element; the same value, NaN and inf included, rounded differently: where eps1 * eps1 underflows
float32, eps1 below about 2.6e-23, e is 0 and a row or column of zero gradients gives NaN, in torch and here).
Parameters agree with torch.optim.Adafactor to float32 rounding, and the kernel is bit-identical at every SIMD
level and thread count.
"""
import math
import operator
from collections.abc import Iterable
from typing import Optional, Sequence, Tuple, Union

import torch

from .. import _C
from ..core.tensors import mark_written
from ._args import GRAD_DTYPES, capability_arg, check_flat, check_tensor, out_code, ptr, threads_arg
from ._hyper import check_adafactor_hyper, check_step

__all__ = ["adafactor_step_", "adafactor_step_reference_", "factored_dims"]

EPS1_DEFAULT = torch.finfo(torch.float32).eps  # torch's eps1=None for the float32 the step computes in
Number = Union[float, torch.Tensor]  # a hyperparameter: a Python number or a one-element tensor
Step = Union[int, torch.Tensor]


def factored_dims(shape: Sequence[int]) -> Optional[Tuple[int, int, int]]:
    """(batches, rows, cols) of a parameter whose second moment is factored (two or more dimensions), else None."""
    shape = tuple(shape)
    if len(shape) < 2:
        return None
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def check_shape(shape) -> Tuple[int, ...]:
    """The parameter's shape as a tuple of ints (numpy's, a torch.Size's, 0-d integer tensors' taken):
    TypeError/ValueError otherwise (floats reached the native step's int64 arguments: pybind11's dump; a str, the
    product of its characters)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"shape must be a sequence of ints (the parameter's shape), got {type(shape).__name__}")
    dims = []
    for s in shape:
        try:
            if isinstance(s, bool):
                raise TypeError
            dim = operator.index(s)
        except TypeError:
            raise TypeError(f"shape must hold ints, got {type(s).__name__} in {shape!r}") from None
        if dim < 0:
            raise ValueError(f"shape must hold sizes >= 0, got {shape!r}")
        dims.append(dim)
    return tuple(dims)


def _check(param, grad, row_var, col_var, variance, shape, param_out):
    shape = check_shape(shape)
    check_tensor("param", param)
    check_tensor("grad", grad)
    n = param.numel()
    if math.prod(tuple(shape)) != n:
        raise ValueError(f"shape {tuple(shape)} does not hold param's {n} elements")
    check_flat("param", param, n, torch.float32)
    check_flat("grad", grad, n)
    if grad.dtype not in GRAD_DTYPES:
        raise ValueError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    dims = factored_dims(shape)
    if dims is not None:
        b, r, c = dims
        for name, t, count in (("row_var", row_var, b * r), ("col_var", col_var, b * c)):
            if t is None:
                raise ValueError(f"a parameter of shape {tuple(shape)} keeps row_var and col_var (factored); "
                                 f"{name} is missing")
            check_flat(name, check_tensor(name, t), count, torch.float32)
    else:
        if variance is None:
            raise ValueError(f"a parameter of shape {tuple(shape)} keeps variance (not factored); it is missing")
        check_flat("variance", check_tensor("variance", variance), n, torch.float32)
    if param_out is not None:
        check_flat("param_out", check_tensor("param_out", param_out), n)
        if param_out.dtype not in GRAD_DTYPES:
            raise ValueError(f"param_out must be bfloat16, float16 or float32, got {param_out.dtype}")
    return dims


def adafactor_step_(param: torch.Tensor, grad: torch.Tensor, *, shape: Sequence[int],
                    row_var: Optional[torch.Tensor] = None, col_var: Optional[torch.Tensor] = None,
                    variance: Optional[torch.Tensor] = None, step: Step, lr: Number = 1e-2,
                    beta2_decay: Number = -0.8, eps1: Optional[Number] = None, eps2: Number = 1e-3, d: Number = 1.0,
                    weight_decay: Number = 0.0, maximize: bool = False,
                    param_out: Optional[torch.Tensor] = None, threads: Optional[int] = None,
                    capability: Optional[str] = None) -> torch.Tensor:
    """One Adafactor step of a whole parameter of shape `shape`, in place, with the native CPU kernel.

    param: contiguous fp32 CPU tensor (the master); grad: fp32, bf16 or fp16 of its numel; row_var and col_var
    (two or more dimensions: numel/shape[-1] and numel/shape[-2] elements) or variance (fewer: numel), fp32,
    read and updated. step: the step being taken, counting from 1. eps1=None: float32's machine epsilon.
    param_out, threads, capability: as for adam_step_. Returns param."""
    dims = _check(param, grad, row_var, col_var, variance, shape, param_out)
    step = check_step(step)
    lr, beta2_decay, eps1, eps2, d, weight_decay = check_adafactor_hyper(lr, beta2_decay, (eps1, eps2), d,
                                                                         weight_decay)
    threads, capability = threads_arg(threads), capability_arg(capability)
    n = param.numel()
    if n == 0:
        return param
    b, r, c = dims if dims is not None else (1, 1, n)
    try:
        _C.adafactor_step(param.data_ptr(), grad.data_ptr(), GRAD_DTYPES[grad.dtype], ptr(row_var), ptr(col_var),
                          ptr(variance), n, factored=dims is not None, batches=b, rows=r, cols=c, step=step, lr=lr,
                          beta2_decay=beta2_decay, eps1=EPS1_DEFAULT if eps1 is None else eps1, eps2=eps2, d=d,
                          weight_decay=weight_decay, maximize=bool(maximize), param_out=ptr(param_out),
                          out_dtype=out_code(param_out), threads=threads, capability=capability)
    finally:
        # written through pointers: autograd is told, as by an in-place torch operation (swapio.ops.adam_step_)
        mark_written(param, row_var, col_var, variance, param_out)
    return param


def adafactor_step_reference_(param: torch.Tensor, grad: torch.Tensor, *, shape: Sequence[int],
                              row_var: Optional[torch.Tensor] = None, col_var: Optional[torch.Tensor] = None,
                              variance: Optional[torch.Tensor] = None, step: Step, lr: Number = 1e-2,
                              beta2_decay: Number = -0.8, eps1: Optional[Number] = None, eps2: Number = 1e-3,
                              d: Number = 1.0, weight_decay: Number = 0.0, maximize: bool = False,
                              param_out: Optional[torch.Tensor] = None, threads: Optional[int] = None,
                              capability: Optional[str] = None) -> torch.Tensor:
    """adafactor_step_ in plain torch ops, on any device: torch's _single_tensor_adafactor on fp32 views."""
    step = check_step(step)
    lr, beta2_decay, eps1, eps2, d, weight_decay = check_adafactor_hyper(lr, beta2_decay, (eps1, eps2), d,
                                                                         weight_decay)
    eps1 = EPS1_DEFAULT if eps1 is None else eps1
    shape = check_shape(shape)
    if (row_var is None or col_var is None) if len(shape) > 1 else variance is None:
        raise ValueError(f"a parameter of shape {shape} keeps " + ("row_var and col_var" if len(shape) > 1
                                                                    else "variance") + "; it is missing")
    if param.numel() == 0:
        return param
    p = param.view(shape)
    g = grad.reshape(shape).float()
    if maximize:
        g = -g
    t = float(step)
    one_minus_beta2 = t ** beta2_decay
    rho = min(lr, 1 / (t ** 0.5))
    alpha = max(eps2, p.norm(2).item() / (p.numel() ** 0.5)) * rho
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    if row_var is not None and col_var is not None and len(shape) > 1:
        rv = row_var.view(shape[:-1] + (1,))
        cv = col_var.view(shape[:-2] + (1, shape[-1]))
        rv.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)), one_minus_beta2)
        cv.lerp_(torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2)), one_minus_beta2)
        var = rv @ cv
        var.div_(rv.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    elif variance is not None:  # (checked above: one of the two holds)
        v = variance.view(shape)
        v.lerp_(g * g, one_minus_beta2)
        var = v.clone()
    update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
    denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
    p.add_(update, alpha=-alpha / denom)
    if param_out is not None:
        param_out.copy_(param.view(-1))
    return param
