"""The safetensors dtype names, and how each torch dtype is stored in a file swapio writes.

DTYPES maps every name the format has to its torch dtype (those this torch knows): the reader (header.py) takes
exactly these, and READ_ONLY's. Dtypes safetensors has a name for are stored as themselves (the safetensors library reads them as
they were). Any other dtype whose elements are whole bytes (complex128, complex32, float8_e8m0fnu,
float4_e2m1fn_x2, bits8, bits16, ...) is stored as its raw bytes, "U8" with one more trailing dimension of the
element size, and the true dtype recorded by the writer's caller (swapio.checkpoint records it in its structure and
gives it back; other readers see uint8). Quantized dtypes (qint8, quint8, qint32, quint4x2, quint2x4) carry a
scale and zero point that are not in their bytes: they are refused with a TypeError naming the tensor (dequantize
first).
"""
import torch

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
          "F64": torch.float64}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
for _name, _attr in (("C64", "complex64"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):  # names the safetensors library (>= 0.5) writes too
        DTYPES.setdefault(_name, getattr(torch, _attr))

NAMES = {dtype: name for name, dtype in DTYPES.items()}  # the names the writer writes: the reader knows each
# Names newer safetensors writers use (the library >= 0.6's save_file) that swapio reads but does not write (older
# readers, swapio's own included, do not know them: it stores these dtypes as raw bytes). "F4" counts 4-bit
# elements, two to a byte: torch's float4_e2m1fn_x2 has half as many along the last dimension (header.py).
READ_ONLY = {name: getattr(torch, attr) for name, attr in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2"))
             if hasattr(torch, attr)}
PACKED_X2 = "F4"
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def dtype_from_name(name, where):
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: unknown dtype {name!r}")
    if dtype in _QUANTIZED:  # never stored (stored_as refuses it); a tensor of it viewed as bytes crashes torch
        raise ValueError(f"{where}: dtype {name!r} is quantized, which a checkpoint cannot hold")
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
