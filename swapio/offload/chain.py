"""cpu_offload_with_hook: a whole model moves to the execution device when it runs and stays there until the next
model of a chain runs (accelerate's semantics, for pipelines that run a few models one after the other).

The model's tensors are kept in pinned host memory (for a GPU), moved with `.data` so every Parameter object stays
the same. Moving in copies on the side stream and makes the compute stream wait on an event; offload() copies
the device values back (the model may have been trained meanwhile) and points the tensors at host memory again.
"""
import torch

from ..core import cuda_copy
from ..core.pinned import empty_pinned
from .registry import unregister
from .units import move_to


def last_copy(events):
    """The event of the last copy issued (None: nothing was copied). Empty tensors are not copied and have no
    event, so the last tensor's entry may be None while copies before it are still running."""
    return next((e for e in reversed(events) if e is not None), None)


class CpuOffloadHook:
    """Returned by cpu_offload_with_hook: offload() sends the model back to host memory, remove() detaches the
    hook (the model stays where it is)."""

    def __init__(self, model, execution_device, prev_module_hook):
        if prev_module_hook is not None and not hasattr(prev_module_hook, "offload"):
            raise TypeError("prev_module_hook must be a hook returned by cpu_offload_with_hook (with .offload())")
        self.model, self.execution_device, self.prev_module_hook = model, execution_device, prev_module_hook
        self.on_device = execution_device.type == "cpu"
        self._host = {}  # tensor -> pinned host copy, for a GPU execution device
        self._handle = None
        self._before = {}  # tensor -> its data before this hook moved it (put back if the constructor fails)
        try:
            if execution_device.type != "cpu":
                for t in self._tensors():
                    host = empty_pinned(tuple(t.shape), t.dtype) if t.numel() else torch.empty(t.shape,
                                                                                                dtype=t.dtype)
                    with torch.no_grad():
                        host.copy_(t.detach())
                    self._before[t] = t.data
                    t.data = host
                    self._host[t] = host
            self._handle = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        except BaseException:
            self.undo()
            raise

    def settle(self):
        """The hook is in place for good: the tensors' earlier data is no longer kept for undo()."""
        self._before = {}

    def undo(self):
        """Detaches the hook and puts every tensor back where it was before the hook was made (a failed or
        interrupted cpu_offload_with_hook leaves the model as it was)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for t, data in self._before.items():
            t.data = data
        self._before = {}

    def _tensors(self):
        seen = set()
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                if t.device.type == "meta":
                    raise ValueError("cpu_offload_with_hook needs the model's weights, but some are on the meta device")
                yield t

    def _pre_forward(self, module, args, kwargs):
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        if self.on_device and any(t.device.type == "cpu" for t in self._host):
            self.offload()  # an offload() that Ctrl-C interrupted: finish it, so that every host copy is current
        if not self.on_device:
            self.load()
        if self.execution_device.type == "cpu":
            return None
        move = move_to(self.execution_device)
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    def load(self):
        """Copies the model to the execution device (side stream; the current stream waits on its event)."""
        device = self.execution_device
        stream = cuda_copy.copy_stream(device)
        events = []
        for t, host in self._host.items():
            with cuda_copy.allocating_on_side_stream(device):
                dev = torch.empty(host.shape, dtype=host.dtype, device=device)
            events.append(cuda_copy.copy_async(dev, host, stream) if host.numel() else None)
            t.data = dev
        current = torch.cuda.current_stream(device)
        last = last_copy(events)
        if last is not None:
            current.wait_event(last)  # copies on one stream complete in order: the last one covers them all
        for t in self._host:
            t.data.record_stream(current)
        self.on_device = True

    def offload(self):
        """Moves the model back to host memory, keeping any change made to it on the device."""
        if not self.on_device or self.execution_device.type == "cpu":
            return
        for t, host in self._host.items():
            if t.device.type == "cpu":
                continue  # moved back by an earlier, interrupted offload(): its host copy is the current one
            if host.numel():
                with torch.no_grad():
                    host.copy_(t.data)  # synchronous: the values are in host memory when this returns
            t.data = host
        self.on_device = False

    def __reduce_ex__(self, protocol):
        # deepcopy of the model copies its hooks: the copy would move (and offload) the original's tensors, and
        # copy the previous models of its chain through prev_module_hook
        raise TypeError("a model with swapio's cpu_offload_with_hook cannot be copied or pickled (copy.deepcopy, "
                        "pickle, torch.save of the model object): call hook.remove() first, copy it, and hook each "
                        "copy")

    __deepcopy__ = __copy__ = lambda self, *memo: self.__reduce_ex__(None)

    def remove(self):
        """Detaches the hook; the model stays where it is now."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        unregister(self.model, self)
