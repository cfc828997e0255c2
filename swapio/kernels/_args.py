"""Argument checks shared by the kernels' tensor-level entries (ops.py: Adam and Lion; adafactor_ops.py):
the dtype codes of the native module, flat CPU buffers, thread counts and SIMD levels."""
import numbers

import torch

from .. import _C

CODES = _C.ADAM_DTYPE_CODES
GRAD_DTYPES = {torch.float32: CODES["float32"], torch.bfloat16: CODES["bfloat16"],
               torch.float16: CODES["float16"]}
OUT_DTYPES = GRAD_DTYPES
LEVELS = ("scalar", "avx2", "avx512")


def check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_flat(name, t, n, dtype=None):
    if t.layout is not torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got {t.layout}")
    if not t.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements, expected {n}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def threads_arg(threads):
    if threads is None or threads == 0:
        return int(min(torch.get_num_threads(), 1024))
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"threads must be an int or None, got {type(threads).__name__}")
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    return int(min(threads, 1024))


def capability_arg(capability):
    if capability is None:
        return ""
    if not isinstance(capability, str):
        raise TypeError(f"capability must be a str or None, got {type(capability).__name__}")
    if capability.lower() not in LEVELS:
        raise ValueError(f"capability must be one of {LEVELS}, got {capability!r}")
    return capability


def ptr(t):
    return 0 if t is None else t.data_ptr()


def out_code(param_out):
    return CODES["none"] if param_out is None else OUT_DTYPES[param_out.dtype]
