"""The GPU side of a step for parameters that live on a GPU: gradients come to the host and updated parameters go
back through pinned buffers, asynchronously, on each device's side copy stream (swapio.core.cuda_copy).

StepCopies orders one step's copies: the side stream first waits for the work queued on the compute stream before
step() (backward's last kernels may still be running: they write the gradients and read the parameters), and at
the end the compute stream waits for the side stream (the next forward reads the new values). The host waits
only for single copies (a gradient it is about to read, a buffer it is about to reuse), never for a device.

CudaStaging: two pinned buffers, each a gradient half and a parameter half, so that while the kernel computes
segment k, the gradient of segment k+1 is on its way in and the parameters of segment k-1 on their way out. A
half is reused only after the copy out of it (parameters) or into it (gradient) has finished: one event each.
"""
import torch

from ..core import cuda_copy
from ..core.pinned import empty_pinned


class StepCopies:
    """Copies between the host and the GPUs during one step(); end() once the step's copies are queued.
    Gradients come over on each device's to-host side stream, parameters go back on its to-device one."""

    def __init__(self, in_backward=False):
        self.in_backward = in_backward  # updates during backward: gradients as their copies in backward hold them
        self.before = {}    # device -> event on the compute stream when this step first copied for it
        self.sent = set()   # devices with copies to the device queued

    def _before(self, device):
        ev = self.before.get(device)
        if ev is None:
            ev = self.before[device] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
        return ev

    def to_host(self, dst, src, device):
        """Queues the copy of src (a gradient) into host memory after the compute stream's work before this step;
        returns its completion event."""
        return cuda_copy.copy_async(dst, src, cuda_copy.copy_stream(device, "to_host"), self._before(device),
                                    hold=False)  # dst: a staging half, which the caller reuses only after it

    def to_device(self, dst, src, device, after=None):
        """Queues the copy of src (new values) into dst (the parameter) after `after` (an event past every
        kernel that reads dst's old value), else after the compute stream's work before this step; returns its
        completion event (src and dst are kept alive until then)."""
        self.sent.add(device)
        return cuda_copy.copy_async(dst, src, cuda_copy.copy_stream(device),
                                    after if after is not None else self._before(device))

    def end(self):
        """The compute streams wait for the copies to the devices (a wait queued on the GPU; the host goes on)."""
        sent, self.sent, self.before = self.sent, set(), {}
        for device in sent:
            torch.cuda.current_stream(device).wait_stream(cuda_copy.copy_stream(device))


class _Pending:
    """A gradient segment on its way into a staging half."""

    __slots__ = ("view", "event")

    def __init__(self, view, event):
        self.view, self.event = view, event

    def wait(self):
        self.event.synchronize()  # this copy only
        return self.view


class CudaStaging:
    """Pinned buffers in rotation for the segments of GPU parameters (see the module's docstring)."""

    def __init__(self, slot_bytes, count=2):
        self.slot_bytes, self.count = slot_bytes, count
        self._buffers = None
        self._grad_events = [None] * count   # the copy into each gradient half
        self._param_events = [None] * count  # the copy out of each parameter half
        self._next = 0

    @property
    def capacity(self):
        """Elements per segment (gradient in, parameter out, each up to 4 bytes an element): a multiple of 1024,
        so of the int8 block."""
        return max(1024, self.slot_bytes // 8 // 1024 * 1024)

    @property
    def pinned_bytes(self):
        return self.capacity * 8 * self.count if self._buffers is not None else 0

    def _halves(self, i):
        if self._buffers is None:
            self._buffers = [empty_pinned(self.capacity * 8, torch.uint8) for _ in range(self.count)]
        half = self.capacity * 4
        return self._buffers[i][:half], self._buffers[i][half:]

    def segments(self, w, copies, host_grad=None, out=True):
        """(a, b, gradient of elements [a, b) on the host, parameter half for the kernel's output, buffer index)
        for each segment of the GPU parameter of Work w. host_grad: w's whole gradient already on the host (copied
        during backward), else each segment's is copied in, the next one while the caller computes this one."""
        cap = self.capacity
        bounds = [(a, min(a + cap, w.numel)) for a in range(0, w.numel, cap)]
        pending = None
        for k, (a, b) in enumerate(bounds):
            i = self._take()
            if host_grad is not None:
                grad = host_grad[a:b]
            else:
                if pending is None:
                    pending = self._fetch(w, a, b, i, copies)
                grad = pending.wait()
                pending = None
                if k + 1 < len(bounds):  # the next segment's gradient comes in while this one computes
                    pending = self._fetch(w, *bounds[k + 1], (i + 1) % self.count, copies)
            if not out:  # the caller copies the new values from elsewhere (a pinned master)
                yield a, b, grad, None, i
                continue
            half = self._halves(i)[1]
            self._wait(self._param_events, i)  # the copy out of this parameter half has finished
            yield a, b, grad, half[:(b - a) * w.t.element_size()].view(w.t.dtype), i

    def _take(self):
        i = self._next
        self._next = (i + 1) % self.count
        return i

    def _fetch(self, w, a, b, i, copies):
        self._wait(self._grad_events, i)
        view = self._halves(i)[0][:(b - a) * w.grad.element_size()].view(w.grad.dtype)
        event = copies.to_host(view, w.grad[a:b], w.t.device)
        self._grad_events[i] = event
        return _Pending(view, event)

    def sent(self, i, event):
        """The parameter half of buffer i is being copied out until `event`."""
        self._param_events[i] = event

    @staticmethod
    def _wait(events, i):
        ev, events[i] = events[i], None
        if ev is not None:
            ev.synchronize()

    def sync(self):
        """Waits for every copy into or out of the buffers (before they are freed, or after an error)."""
        for i in range(self.count):
            self._wait(self._grad_events, i)
            self._wait(self._param_events, i)
