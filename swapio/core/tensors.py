"""Checks that turn a tensor into (pointer, byte count) for the native core, and how its writes through that
pointer are shown to autograd."""
import contextlib
from typing import Iterator, Optional, Tuple

import torch


def check_dense(tensor: torch.Tensor, name: str = "tensor") -> None:
    """ValueError for sparse (COO, CSR, ...) and nested tensors, whose values are not one block of memory."""
    if tensor.is_nested:  # (a strided one raised torch's "Internal error: NestedTensorImpl doesn't support sizes")
        raise ValueError(f"{name} is a nested tensor (torch.nested); swapio moves dense tensors only: move each of "
                         "its components (.unbind()) instead")
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


def check_writable_in_place(tensor: torch.Tensor, name: str = "tensor") -> None:
    """RuntimeError where torch refuses an in-place copy_ into `tensor`, or where copy_ would record itself in the
    graph (a native write cannot: the gradient would flow to the overwritten values' computation)."""
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"Inplace update to inference tensor outside InferenceMode is not allowed: {name} was made "
                           "under torch.inference_mode(); read into it inside torch.inference_mode()")
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return
    if tensor.is_leaf or (tensor._base is not None and tensor._base.is_leaf):
        view = "a view of " if not tensor.is_leaf else ""
        raise RuntimeError(f"{name} is {view}a leaf Variable that requires grad: torch refuses an in-place write into "
                           "it; read under torch.no_grad() (as for copy_ into a parameter)")
    raise RuntimeError(f"{name} requires grad and is part of an autograd graph: a read into it cannot be recorded "
                       "there (copy_ would be), so gradients would flow to the values it overwrote; read into "
                       "tensor.detach() or a new tensor, or under torch.no_grad()")


def mark_written(*tensors: Optional[torch.Tensor]) -> None:
    """Tells autograd that native code wrote these tensors in place (None entries skipped), as an in-place torch
    operation does: a backward through a graph that saved their old values then raises instead of using the new."""
    torch.autograd.graph.increment_version([t for t in tensors if t is not None])


_unsafe_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def set_version(tensor: torch.Tensor, version: int) -> None:
    """Sets the tensor's version counter (shared with its views); RuntimeError on a torch without the setter."""
    if _unsafe_set_version is None:
        raise RuntimeError("this torch cannot set a tensor's version counter")
    try:
        _unsafe_set_version((tensor,), (version,))
    except TypeError:  # older torch: one tensor and one version
        _unsafe_set_version(tensor, version)


CAN_SET_VERSION = _unsafe_set_version is not None


@contextlib.contextmanager
def restoring(tensor: torch.Tensor) -> Iterator[None]:
    """Writes inside put back bytes the tensor held before (a swapped-out tensor refilled): autograd is not told,
    so a graph that saved the tensor before it was swapped out still uses it. Where torch cannot set the counter
    back, the write counts as a change (a backward through such a graph raises; never silently wrong). An inference
    tensor counts no versions, and torch refuses writes into it outside inference mode: this one puts its own
    bytes back, so it runs in inference mode."""
    if tensor.is_inference():
        with torch.inference_mode():
            yield
        return
    if not CAN_SET_VERSION:
        yield
        return
    version = tensor._version
    try:
        yield
    finally:
        set_version(tensor, version)
