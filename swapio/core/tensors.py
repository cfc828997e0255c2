"""Checks that turn a tensor into (pointer, byte count) for the native core."""
from typing import Tuple

import torch


def check_dense(tensor: torch.Tensor, name: str = "tensor") -> None:
    """ValueError for sparse (COO, CSR, ...) tensors, whose values are not one block of memory."""
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} is a sparse tensor ({tensor.layout}); swapio moves dense (strided) tensors "
                         "only: call .to_dense() first")


def cpu_memory(tensor: object, name: str = "tensor") -> Tuple[int, int]:
    """(data_ptr, nbytes) of a contiguous CPU tensor; TypeError/ValueError naming the problem otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_dense(tensor, name)
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; this call needs a CPU tensor "
                         "(SwapStore moves GPU tensors through pinned memory)")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{name} is a lazily conjugated or negated view: its memory does not hold its values "
                         "(call .resolve_conj() / .resolve_neg() first)")
    nbytes = tensor.numel() * tensor.element_size()
    # A storage shrunk under the tensor (storage.resize_) leaves data_ptr() pointing past its memory.
    needed, held = storage_bytes_needed(tensor), tensor.untyped_storage().nbytes()
    if nbytes and needed > held:
        raise ValueError(f"{name} spans {needed} bytes of its storage but the storage holds only {held} "
                         "(was the storage resized or released?)")
    return int(tensor.data_ptr()), nbytes


def storage_bytes_needed(tensor: torch.Tensor) -> int:
    """The bytes of its storage a non-empty tensor reaches: its offset plus the span of its elements (more than
    the storage holds when the storage was resized or released under it)."""
    extent = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
    return int((tensor.storage_offset() + extent) * tensor.element_size())


def spans_whole_storage(tensor: torch.Tensor) -> bool:
    """True if the tensor covers all of its storage (so releasing the storage releases nothing else)."""
    storage = tensor.untyped_storage()
    return bool(tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == storage.nbytes())
