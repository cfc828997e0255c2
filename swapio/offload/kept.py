"""Saved tensors that saved-tensor hooks leave where they are. The hooks turn autograd's check for a saved tensor
changed in place off, for every tensor they see: Kept makes that check at unpack instead."""


class Kept:
    """A saved tensor left where it was (pack did not move it), with its version when saved. Saved-tensor hooks
    turn autograd's check for a saved tensor changed in place off; unpack makes it instead."""
    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        # detached (the same memory and version counter): a saved output is handed over with its grad_fn, the node
        # that keeps this, and the cycle held the whole graph until the garbage collector's next full pass
        self.tensor, self.version = tensor.detach(), tensor._version

    def unpack(self):
        tensor = self.tensor
        if tensor._version != self.version:
            raise modified_in_place(tensor.dtype, tensor.size(),
                                    f"is at version {tensor._version}; expected version {self.version} instead")
        return tensor


def modified_in_place(dtype, size, what):
    """Autograd's error for a saved tensor changed in place, with what happened to it."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a tensor saved for backward ({dtype}, size {list(size)}) {what}. Without offload autograd refuses "
        "this backward too: change a copy of the tensor instead (torch.autograd.set_detect_anomaly(True) shows the "
        "operation that saved it).")
