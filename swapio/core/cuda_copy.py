"""Copies between host and GPU, both directions: one side stream per device and direction, events instead of
stream-wide syncs, and the source kept alive until the copy that reads it has finished. Host-to-GPU from pinned
memory (copy_async, DeviceCopyFuture); GPU-to-host into a per-device pinned staging buffer (to_host).

Nothing here touches CUDA unless a CUDA device is asked for, so CPU-only work never creates a CUDA context.
"""
import contextlib
import threading
import time

import torch

from .futures import Future
from .pinned import GrowingBlock, cuda_register

_lock = threading.Lock()
_streams = {}    # (device index, direction) -> torch.cuda.Stream used for staging copies
_in_flight = []  # (event, objects the copy reads or writes), pruned as the events complete
_staging = {}    # CUDA device -> GrowingBlock to_host copies into (one copy at a time: see to_host)


def normalize_device(device):
    """A torch.device with an explicit index for CUDA ("cuda" -> "cuda:<current device>"), and none for the CPU
    ("cpu:0" -> "cpu", the device torch gives its CPU tensors: swap_in(device="cpu:0") made a new tensor instead
    of refilling its released source); ints mean CUDA."""
    if isinstance(device, bool):
        raise TypeError("device must be a str, int or torch.device, got bool")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        device = torch.device(device)
    elif not isinstance(device, torch.device):
        raise TypeError(f"device must be a str, int or torch.device, got {type(device).__name__}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu" and device.index is not None:
        device = torch.device("cpu")
    return device


def usable_device(device, call):
    """normalize_device(device) for `call` (named in the message, e.g. "swap_in"); a RuntimeError saying what to
    do when it names CUDA and this torch cannot use it (torch's own would be an AssertionError, "Torch not
    compiled with CUDA enabled", or a failing stream, naming neither the call nor the argument)."""
    if isinstance(device, int) and not isinstance(device, bool):
        cuda = True  # an int means a CUDA device
    else:
        cuda = isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise RuntimeError(f"{call}(device={device!r}) needs CUDA, but {why}; use device='cpu'")
    return normalize_device(device)


def copy_stream(device, direction="to_device"):
    """The side stream swapio copies on for a CUDA device (created once per device and direction): host-to-device
    copies on one, device-to-host ("to_host") on another, so that the two directions of PCIe run at once and a
    copy in one never waits behind the other."""
    key = (normalize_device(device).index, direction)
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=key[0])
    return stream


def allocating_on_side_stream(device):
    """A context in which CUDA allocations for `device` belong to its copy stream (so the copy writing them
    needs to wait for nothing); a no-op context for other devices."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(copy_stream(device))


def keep_until(event, *objects):
    """Holds `objects` (pinned sources, device targets) until `event` has completed on the GPU."""
    with _lock:
        _prune_locked()
        _in_flight.append((event, objects))


def release_finished():
    """Drops the references of copies that have completed."""
    with _lock:
        _prune_locked()


def _prune_locked():
    _in_flight[:] = [(ev, objs) for ev, objs in _in_flight if not ev.query()]


def copy_async(dst, src, stream, wait_for=None, hold=True):
    """Queues dst.copy_(src) on `stream` (after `wait_for`, an event, if given) and returns the completion event.

    A swapio pinned source is registered with CUDA first (lazily: empty_pinned registers nothing while CUDA is
    unused), and `src` and `dst` stay referenced until the event completes, so neither can be freed or reused
    while the copy reads or writes them. hold=False: nothing is referenced; the device tensor's memory is marked
    in use by `stream` (record_stream) instead, so that the caching allocator hands it out again only after the
    copy, while the tensor itself may be freed at once (a gradient that zero_grad() drops); the caller keeps the
    host tensor alive.
    """
    for t in (src, dst):
        if t.device.type == "cpu":
            cuda_register(t, stream.device)
    if wait_for is not None:
        stream.wait_event(wait_for)
    with torch.cuda.stream(stream), torch.no_grad():
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    if hold:
        keep_until(event, src, dst)
    else:
        for t in (src, dst):
            if t.device.type == "cuda":
                t.record_stream(stream)
    return event


def wait_event(event, timeout=None):
    """Blocks until `event` completed (TimeoutError after `timeout` seconds); waits for nothing else."""
    if timeout is None:
        event.synchronize()
        return
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the copy to the GPU did not finish within {timeout} s")
        time.sleep(0.0002)


class DeviceCopyFuture(Future):
    """A read into pinned staging memory followed by a copy to a GPU tensor on the side stream.

    done() is True only once the copy itself has completed; it issues the copy as soon as it sees the read
    finished. wait() waits for the read and that copy only (never for other work queued on the GPU), then makes
    the caller's current stream wait on the copy before the tensor is used there.
    """

    __slots__ = ("_read", "_issue", "_event", "_target", "_issue_lock")

    def __init__(self, read, issue, target):
        super().__init__()
        self._read, self._issue, self._target = read, issue, target  # issue() -> event, called once
        self._event = None
        self._issue_lock = threading.Lock()

    def _ensure_issued(self, timeout=None):
        self._read.wait(timeout)  # raises the read's OSError
        with self._issue_lock:
            if self._event is None:
                self._event = self._issue()
        return self._event

    def done(self):
        if not self._read.done():
            return False
        if self._read.exception() is not None:
            return True
        return self._ensure_issued().query()

    def wait(self, timeout=None):
        start = time.monotonic()
        self.observed = True
        event = self._ensure_issued(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        wait_event(event, left)
        current = torch.cuda.current_stream(self._target.device)
        current.wait_event(event)
        self._target.record_stream(current)
        release_finished()
        return self._target

    result = wait

    def exception(self, timeout=None):
        start = time.monotonic()
        self.observed = True
        failed = self._read.exception(timeout)  # the read's error, or its follow-up's (interrupted: RuntimeError)
        if failed is not None:
            return failed
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        try:
            self.wait(left)
        except OSError as exc:  # the copy's TimeoutError
            return exc
        return None

    def __repr__(self):
        return f"<swapio.Future {'done' if self.done() else 'pending'} (read + copy to {self._target.device})>"


def to_host(g):
    """The tensor in host memory: a CPU tensor as it is; a CUDA one copied on the device's side copy stream
    ("to_host") into the device's pinned staging buffer, after the compute stream's work that produced it,
    waiting for that copy only (not the device). The result is a view of that buffer, valid until the next
    call for the device: autograd runs a device's hooks on one thread, and every caller consumes it (adds,
    copies) before returning; a caller that keeps it clones it (in_staging says when)."""
    if g.device.type == "cpu":
        return g
    nbytes = g.numel() * g.element_size()
    with _lock:
        staging = _staging.setdefault(g.device, GrowingBlock(size=_exactly))
    host = staging.at_least(nbytes)[:nbytes].view(g.dtype).view(g.shape)
    produced = torch.cuda.Event()
    produced.record(torch.cuda.current_stream(g.device))
    # hold=False: the caching allocator may not hand g's memory out before the copy ran (record_stream)
    copy_async(host, g, copy_stream(g.device, "to_host"), wait_for=produced, hold=False).synchronize()
    return host


def in_staging(t):
    """Whether t lies in a to_host staging buffer (and so is overwritten by the device's next to_host)."""
    return any(b.holds(t) for b in list(_staging.values()))


def staging_bytes():
    """Bytes of the to_host staging buffers (one per CUDA device copied from so far)."""
    return sum(b.nbytes for b in list(_staging.values()))


def _exactly(nbytes):
    """A staging buffer of just the bytes asked (its size is what memory_report shows as grad_staging)."""
    return max(nbytes, 1)
