"""Tensors as the bytes a checkpoint stores, for every dtype torch has.

Sub-byte dtypes (uint1..7, int1..7) cannot even be copied by torch; every one-byte dtype is therefore handled
through a uint8 view of the same shape and strides, which torch copies like any other tensor."""
import torch


def copyable_dtype(dtype):
    return torch.uint8 if dtype.itemsize == 1 else dtype


def copyable(t):
    """t, or for a one-byte dtype a uint8 view of it (same shape, same strides)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def flat_bytes(t):
    """The elements of t in row-major order as a 1-D uint8 tensor on t's device (a view when t is contiguous,
    else one contiguous copy of t)."""
    return copyable(t).contiguous().reshape(-1).view(torch.uint8)


def place(dst_bytes, t):
    """dst_bytes (a uint8 slice of t's byte count, offset a multiple of t's element size) as a tensor of t's
    dtype and shape, ready to copy_ t (through copyable) into."""
    src = copyable(t)
    return dst_bytes.view(src.dtype).view(src.shape), src
