"""How each torch dtype is stored in a safetensors file.

Dtypes safetensors has a name for are stored as themselves (the safetensors library reads them as they were).
Any other dtype whose elements are whole bytes (complex128, complex32, float8_e8m0fnu, float4_e2m1fn_x2, bits8,
bits16, ...) is stored as its raw bytes, "U8" with one more trailing dimension of the element size, and the true
dtype recorded in the checkpoint's structure (swapio.checkpoint.load gives it back; other readers see uint8).
Quantized dtypes (qint8, quint8, qint32, quint4x2, quint2x4) carry a scale and zero point that are not in their
bytes: they are refused with a TypeError naming the tensor (dequantize first).
"""
import torch

from ..offload.safetensors_format import DTYPES as _READABLE

# The names safetensors writes; the reader (swapio.offload.safetensors_format) knows each of them.
NAMES = {dtype: name for name, dtype in _READABLE.items()}
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def dtype_from_name(name, where):
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}")
    return dtype


def stored_as(dtype, key):
    """(safetensors dtype name, raw): raw means the tensor is stored as its bytes ("U8", trailing element size)."""
    if dtype in NAMES:
        return NAMES[dtype], False
    if dtype in _QUANTIZED:
        raise TypeError(f"{key}: a quantized tensor ({dtype}) cannot be stored: its scale and zero point are not "
                        "in its bytes (call .dequantize() or .int_repr() first)")
    return "U8", True


def stored_shape(shape, dtype, raw):
    return list(shape) + [dtype.itemsize] if raw else list(shape)
