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

Smaller state: the moments may also be bf16 tensors (stored with stochastic rounding) or uint8 tensors of
int8 block-wise codes with fp32 scales (``swapio.quant`` describes both and is their plain-torch codec);
decoding, the step and encoding run in one pass. ``lion_step_`` is Lion (one moment, sign update, decoupled
weight decay) with the same three state types. ``adafactor_step_`` is Adafactor (torch.optim.Adafactor's
algorithm, factored second moments) of a whole parameter (swapio.kernels.adafactor_ops). ``*_reference_`` are
the same steps in plain torch.
"""
import numbers
import warnings
from typing import List, Optional, Tuple, Union

import torch

from .. import _C
from . import quant
# the checks shared with adafactor_ops, under private names: swapio.ops's namespace shows its API only
from ._args import (GRAD_DTYPES as _GRAD_DTYPES, OUT_DTYPES as _OUT_DTYPES, capability_arg as _capability,
                    check_flat as _check_flat, check_tensor as _check_tensor, out_code as _out_code, ptr as _ptr,
                    threads_arg as _threads)
from ..core._errors import SwapioWarning
from ..core.tensors import mark_written
from ._hyper import check_adam_hyper, check_lion_hyper, check_step

Number = Union[float, torch.Tensor]  # a hyperparameter: a Python number or a one-element tensor
Step = Union[int, torch.Tensor]
OptTensor = Optional[torch.Tensor]

__all__ = ["adam_step_", "adam_step_reference_", "lion_step_", "lion_step_reference_", "adafactor_step_",
           "adafactor_step_reference_", "cpu_capability", "cpu_capabilities"]

_STATES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}  # moment dtype -> state type
_warned_capability = False


def cpu_capability() -> str:
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
    return str(info["active"])


def cpu_capabilities() -> List[str]:
    """SIMD levels this CPU supports, lowest first (each can be passed as ``capability=``)."""
    return list(_C.adam_capability_info()["supported"])


def _check_scales_only_with_codes(moments):
    """A scale given with float moments would be ignored: a caller whose state got mixed up should hear of it."""
    for name, t, scale in moments:
        if scale is not None and isinstance(t, torch.Tensor) and t.dtype != torch.uint8:
            raise ValueError(f"{name}_scale is only for uint8 {name} (int8 codes); {name} is {t.dtype}")


def _check_buffers(param, grad, moments, param_out):
    """Checks param, grad, the moments ((name, tensor, scale), ...) and param_out; returns the state type."""
    _check_scales_only_with_codes(moments)
    _check_tensor("param", param)
    _check_tensor("grad", grad)
    n = param.numel()
    _check_flat("param", param, n, torch.float32)
    _check_flat("grad", grad, n)
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
    state = None
    for name, t, scale in moments:
        _check_tensor(name, t)
        _check_flat(name, t, n)
        kind = _STATES.get(t.dtype)
        if kind is None:
            raise ValueError(f"{name} must be float32, bfloat16 or uint8 (int8 codes), got {t.dtype}")
        if state is not None and kind != state:
            raise ValueError(f"the moments must share one dtype, got {moments[0][1].dtype} and {t.dtype}")
        state = kind
        if kind == "int8":
            if scale is None:
                raise ValueError(f"uint8 {name} (int8 codes) needs {name}_scale")
            _check_flat(f"{name}_scale", _check_tensor(f"{name}_scale", scale), quant.num_blocks(n), torch.float32)
            # (a negative scale: ValueError from the native step, which checks on this thread, not torch's)
    if param_out is not None:
        _check_flat("param_out", _check_tensor("param_out", param_out), n)
        if param_out.dtype not in _OUT_DTYPES:
            raise ValueError(f"param_out must be bfloat16, float16 or float32, got {param_out.dtype}")
    return state


def _seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return int(seed)


def _index_base(index_base, n):
    """index_base, whose elements' indices index_base + i (i < n) the kernels hold in an int64: past 2**63 - 1
    they reached the binding (pybind11's dump of its C++ signature) or overflowed."""
    if isinstance(index_base, bool) or not isinstance(index_base, numbers.Integral) or index_base < 0:
        raise ValueError(f"index_base must be an int >= 0, got {index_base!r}")
    if index_base + n > 1 << 63:
        raise ValueError(f"index_base + the element count must be <= 2**63, got {index_base!r} + {n}")
    return int(index_base)


def _check_counter(nonfinite):
    """nonfinite is None or a one-element int64 tensor: checked before the step, since the count is added after it
    (a list raised an AttributeError once the parameter was written; an int8 counter wrapped, two elements both
    counted)."""
    if nonfinite is None:
        return
    if not isinstance(nonfinite, torch.Tensor):
        raise TypeError(f"nonfinite must be None or a one-element int64 tensor, got {type(nonfinite).__name__}")
    if nonfinite.dtype != torch.int64 or nonfinite.numel() != 1:
        raise ValueError(f"nonfinite must be a one-element int64 tensor, got {nonfinite.dtype} "
                         f"{tuple(nonfinite.shape)}")


def _count(nonfinite, found):
    if nonfinite is not None and found:
        nonfinite.add_(found)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: Step, lr: Number, beta1: Number, beta2: Number, eps: Number, weight_decay: Number,
               adamw: bool = True, maximize: bool = False, amsgrad: bool = False,
               max_exp_avg_sq: OptTensor = None, param_out: OptTensor = None, threads: Optional[int] = None,
               capability: Optional[str] = None, exp_avg_scale: OptTensor = None,
               exp_avg_sq_scale: OptTensor = None, seed: int = 0, index_base: int = 0,
               nonfinite: OptTensor = None) -> torch.Tensor:
    """One Adam (``adamw=False``: L2 weight decay) or AdamW step, in place, with the native CPU kernel.

    param, exp_avg, exp_avg_sq (and max_exp_avg_sq with ``amsgrad``): contiguous fp32 CPU tensors of one
    numel. grad: contiguous CPU tensor of that numel, fp32, bf16 or fp16 (widened in registers).
    param_out: None, or a contiguous CPU bf16/fp16/fp32 tensor of that numel that receives the updated
    param rounded to nearest even (equal to ``param.to(param_out.dtype)``) in the same pass.
    step: the step being taken, counting from 1 (torch's ``state["step"]`` after its increment).
    lr and the other hyperparameters: numbers or one-element tensors.
    threads: threads to use (None or 0: ``torch.get_num_threads()``).
    capability: None (the active level) or ``"scalar"``/``"avx2"``/``"avx512"`` (ValueError if missing).
    Smaller state: exp_avg and exp_avg_sq may instead both be bf16 (stochastic rounding from ``seed``, ``step``
    and the element index ``index_base + i``) or both uint8 int8 codes with fp32 ``exp_avg_scale`` and
    ``exp_avg_sq_scale`` of ``swapio.quant.num_blocks(numel)`` elements each; not with amsgrad. ``nonfinite``:
    None or a one-element int64 tensor to which the count of non-finite new int8 moments (stored as 0) is added.
    Returns ``param``. Raises TypeError for non-tensors, ValueError for bad devices, layouts, dtypes,
    sizes or hyperparameters.
    """
    state = _check_buffers(param, grad, (("exp_avg", exp_avg, exp_avg_scale),
                                         ("exp_avg_sq", exp_avg_sq, exp_avg_sq_scale)), param_out)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs max_exp_avg_sq")
        if state != "fp32":
            raise ValueError(f"amsgrad needs float32 moments, got {exp_avg.dtype}")
        _check_flat("max_exp_avg_sq", _check_tensor("max_exp_avg_sq", max_exp_avg_sq), param.numel(), torch.float32)
    step = check_step(step)
    lr, beta1, beta2, eps, weight_decay = check_adam_hyper(lr, beta1, beta2, eps, weight_decay)
    threads, capability = _threads(threads), _capability(capability)
    seed, index_base = _seed(seed), _index_base(index_base, param.numel())
    _check_counter(nonfinite)
    n = param.numel()
    if n == 0:
        return param
    # the kernel writes through pointers: autograd is told, as by torch's own in-place steps (even if it fails
    # partway, as some of the memory may be written)
    written = (param, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out,
               max_exp_avg_sq if amsgrad else None)
    try:
        _adam_native(param, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq, param_out,
                     n, state, nonfinite, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay, adamw=bool(adamw), maximize=bool(maximize), amsgrad=bool(amsgrad),
                     seed=seed, index_base=index_base, threads=threads, capability=capability)
    finally:
        mark_written(*written)
    return param


def _adam_native(param, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq, param_out, n,
                 state, nonfinite, *, step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, amsgrad, seed,
                 index_base, threads, capability):
    if state != "fp32":
        found = _C.adam_step_state(
            param.data_ptr(), grad.data_ptr(), _GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(), _ptr(exp_avg_scale),
            exp_avg_sq.data_ptr(), _ptr(exp_avg_sq_scale), n, state=_C.STATE_CODES[state], seed=seed,
            index_base=index_base, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, adamw=adamw, maximize=maximize, param_out=_ptr(param_out),
            out_dtype=_out_code(param_out), threads=threads, capability=capability)
        _count(nonfinite, found)
        return
    _C.adam_step(
        param.data_ptr(), grad.data_ptr(), _GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
        maximize=maximize, amsgrad=amsgrad, max_exp_avg_sq=_ptr(max_exp_avg_sq) if amsgrad else 0,
        param_out=_ptr(param_out), out_dtype=_out_code(param_out), threads=threads, capability=capability)


def lion_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: Number, beta1: Number = 0.9,
               beta2: Number = 0.99, weight_decay: Number = 0.0, maximize: bool = False,
               step: Step = 1, param_out: OptTensor = None, threads: Optional[int] = None,
               capability: Optional[str] = None, exp_avg_scale: OptTensor = None, seed: int = 0,
               index_base: int = 0, nonfinite: OptTensor = None) -> torch.Tensor:
    """One Lion step (Chen et al. 2023), in place, with the native CPU kernel:
    ``param *= 1 - lr*wd; param -= lr * sign(beta1*exp_avg + (1-beta1)*grad); exp_avg = beta2*exp_avg +
    (1-beta2)*grad``, in the float32 operation order of ``lion_step_reference_``.

    param: contiguous fp32 CPU tensor; grad: fp32, bf16 or fp16 of its numel; exp_avg: fp32, bf16 (stochastic
    rounding from ``seed``, ``step``, ``index_base + i``) or uint8 int8 codes with fp32 ``exp_avg_scale``.
    step only seeds the bf16 rounding. The other arguments are those of ``adam_step_``. Returns ``param``.
    """
    state = _check_buffers(param, grad, (("exp_avg", exp_avg, exp_avg_scale),), param_out)
    step = check_step(step)
    lr, beta1, beta2, weight_decay = check_lion_hyper(lr, beta1, beta2, weight_decay)
    threads, capability = _threads(threads), _capability(capability)
    seed, index_base = _seed(seed), _index_base(index_base, param.numel())
    _check_counter(nonfinite)
    n = param.numel()
    if n == 0:
        return param
    try:
        found = _C.lion_step(
            param.data_ptr(), grad.data_ptr(), _GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(), _ptr(exp_avg_scale), n,
            state=_C.STATE_CODES[state], seed=seed, index_base=index_base, step=step, lr=lr,
            beta1=beta1, beta2=beta2, weight_decay=weight_decay, maximize=bool(maximize), param_out=_ptr(param_out),
            out_dtype=_out_code(param_out), threads=threads, capability=capability)
    finally:
        mark_written(param, exp_avg, exp_avg_scale, param_out)  # as for adam_step_
    _count(nonfinite, found)
    return param


class _Decoded:
    """The fp32 values of moments stored as bf16 or int8, written back encoded (the references' codec)."""

    def __init__(self, moments, seed, step, index_base):
        self.moments, self.seed, self.step, self.index_base = moments, seed, step, index_base
        self.values = []
        for (t, scale, signed), name in zip(moments, ("exp_avg", "exp_avg_sq")):
            if t.dtype == torch.uint8:
                if scale is None:  # (an AttributeError; decoded before anything is written, as the kernel checks)
                    raise ValueError(f"uint8 {name} (int8 codes) needs {name}_scale")
                try:
                    self.values.append(quant.dequantize(t, scale, signed))
                except ValueError as exc:  # (a wrong count of scales failed at the end, the parameter updated)
                    raise ValueError(f"{name}_scale: {exc}") from None
            else:
                self.values.append(t.reshape(-1).float())

    def store(self):
        if len(self.values) == 2 and self.moments[0][0].dtype == torch.uint8:
            quant.drop_nonfinite_pairs(*self.values)
        bits = None
        for j, ((t, scale, signed), x) in enumerate(zip(self.moments, self.values)):
            if t.dtype == torch.uint8:
                codes, new_scale = quant.quantize(x, signed)
                t.reshape(-1).copy_(codes)
                scale.reshape(-1).copy_(new_scale)
            elif t.dtype == torch.bfloat16:
                if bits is None:
                    bits = quant.sr_bits(self.seed, self.step, self.index_base, x.numel())
                t.reshape(-1).copy_(quant.round_bf16_stochastic(x, (bits >> (16 * j)) & 0xFFFF))
            else:
                t.reshape(-1).copy_(x)


@torch.no_grad()
def lion_step_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: Number,
                         beta1: Number = 0.9, beta2: Number = 0.99, weight_decay: Number = 0.0,
                         maximize: bool = False, step: Step = 1, param_out: OptTensor = None,
                         threads: Optional[int] = None, capability: Optional[str] = None,
                         exp_avg_scale: OptTensor = None, seed: int = 0, index_base: int = 0,
                         nonfinite: OptTensor = None) -> torch.Tensor:
    """``lion_step_`` in plain torch ops (the form of the Lion paper's pseudocode), on any device. exp_avg may be
    fp32, bf16 or uint8 codes (decoded, stepped and encoded with ``swapio.quant``). ``threads``,
    ``capability`` and ``nonfinite`` are accepted for signature compatibility and ignored. Returns ``param``."""
    step = check_step(step)
    lr, beta1, beta2, weight_decay = check_lion_hyper(lr, beta1, beta2, weight_decay)
    _check_scales_only_with_codes([("exp_avg", exp_avg, exp_avg_scale)])
    state = _Decoded([(exp_avg, exp_avg_scale, True)], seed, step, _index_base(index_base, param.numel()))
    m = state.values[0]
    p = param.reshape(-1)
    g = grad.reshape(-1).to(p.dtype)
    if maximize:
        g = -g
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    update = m.mul(beta1).add_(g, alpha=1 - beta1).sign_()
    p.add_(update, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)
    state.store()
    if param_out is not None:
        param_out.copy_(param.reshape(param_out.shape))
    return param


@torch.no_grad()
def adam_step_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         *, step: Step, lr: Number, beta1: Number, beta2: Number, eps: Number,
                         weight_decay: Number, adamw: bool = True, maximize: bool = False, amsgrad: bool = False,
                         max_exp_avg_sq: OptTensor = None, param_out: OptTensor = None, threads: Optional[int] = None,
                         capability: Optional[str] = None, exp_avg_scale: OptTensor = None,
                         exp_avg_sq_scale: OptTensor = None, seed: int = 0, index_base: int = 0,
                         nonfinite: OptTensor = None) -> torch.Tensor:
    """``adam_step_`` in plain torch ops (torch's ``_single_tensor_adam``, op for op), on any device.

    The state tensors and param share a floating dtype (normally fp32); grad may be of any floating dtype
    and is converted to param's. Moments stored as bf16 or uint8 codes are decoded to fp32, stepped and
    encoded with ``swapio.quant``. ``threads``, ``capability`` and ``nonfinite`` are accepted for signature
    compatibility and ignored. Returns ``param``.
    """
    _check_scales_only_with_codes([("exp_avg", exp_avg, exp_avg_scale), ("exp_avg_sq", exp_avg_sq, exp_avg_sq_scale)])
    if exp_avg.dtype in (torch.bfloat16, torch.uint8):
        state = _Decoded([(exp_avg, exp_avg_scale, True), (exp_avg_sq, exp_avg_sq_scale, False)], seed,
                         check_step(step), _index_base(index_base, param.numel()))
        adam_step_reference_(param.reshape(-1), grad.reshape(-1), *state.values, step=step, lr=lr, beta1=beta1,
                             beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, maximize=maximize)
        state.store()
        if param_out is not None:
            param_out.copy_(param.reshape(param_out.shape))
        return param
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(name, t)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sq")
    if param_out is not None:
        _check_tensor("param_out", param_out)
    n = param.numel()
    sized: Tuple[Tuple[str, OptTensor], ...] = (
        ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
        ("max_exp_avg_sq", max_exp_avg_sq if amsgrad else None), ("param_out", param_out))
    for name, given in sized:
        if given is not None and given.numel() != n:
            raise ValueError(f"{name} has {given.numel()} elements, param has {n}")
    step = check_step(step)
    lr, beta1, beta2, eps, weight_decay = check_adam_hyper(lr, beta1, beta2, eps, weight_decay)

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
    step_f = float(step)  # torch keeps the step in a float tensor
    bias_correction1 = 1 - beta1 ** step_f
    bias_correction2 = 1 - beta2 ** step_f
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    if amsgrad:
        assert max_exp_avg_sq is not None  # checked above
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_out is not None:
        param_out.copy_(param.reshape(param_out.shape))
    return param
from .adafactor_ops import adafactor_step_, adafactor_step_reference_  # noqa: E402,F401  (re-exported)
