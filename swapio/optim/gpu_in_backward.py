"""in_backward=True for parameters that live on a GPU (offload="cpu"): each parameter is updated on the CPU as
soon as its gradient is complete, while backward goes on with earlier layers.

GradCopies' hook queues the gradient's copy to pinned RAM and calls ready(p); a worker thread takes the parameters
ready so far (a batch), waits for their copies alone, steps them with the gradients as backward produced them
(those copies) and queues their new values' copies to the GPU
on the side stream, which first waits for the work the compute stream had queued by then (the kernels of
backward that still read the old values). The compute stream is made to wait for those copies only at step(),
before the next forward; backward itself never waits for them.

step() then waits for the worker and skips the parameters it stepped; a second step() before zero_grad() steps
them again with the same gradients, as torch's optimizers do. A gradient changed after its parameter was
updated (torch's clip_grad_norm_, GradScaler.unscale_) cannot take effect: step() raises instead of ignoring it.

The optimizer's step is held weakly but for the work in flight (worker.HeldStep): dropped right after (or during)
a backward, it still updates every parameter that backward handed it; once freed, the compute streams wait for
those copies (step() would have made them) and an update that failed is a SwapioWarning (no step() is left to
raise it).
"""
import threading
import warnings
import weakref

import torch

from ..core._errors import SwapioWarning
from ..core._fork_lock import ForkAwareLock
from ..core._signals import DeferredSigint
from ..core.backward_end import on_backward_end
from .cuda_staging import StepCopies
from .params import on_gpu, shard
from .worker import IN_BACKWARD, HeldStep, UpdateWorker, second_backward_error

# GPU parameters a live in_backward=True optimizer updates during backward: id(p) -> (weak p, weak GpuInBackward).
# Its hooks stay on the model while it lives: a second optimizer given them (a new one for the next phase, the
# old one still referenced by a scheduler or a variable) had its steps silently mixed with the old one's updates.
_updaters = {}
_updaters_lock = threading.Lock()


def check_unclaimed(params, index_of, name, claimant=None):
    """ValueError where a GPU parameter among params is updated during backward by another live in_backward=True
    optimizer (index_of(p): its index here, for the message; name: this optimizer's class name); then claimant
    (this optimizer's GpuInBackward, if it has one) claims them."""
    gpu = [p for p in params if p.requires_grad and on_gpu(shard(p))]
    with _updaters_lock:
        for p in gpu:
            held, other = _updaters.get(id(p), (None, None))
            other = other() if held is not None and held() is p else None
            if other is not None and other is not claimant and not other.released:
                raise ValueError(f"parameter {index_of(p)} given to this {name} is on a GPU and updated during "
                                 "backward by another swapio optimizer built with in_backward=True and still alive: "
                                 "its hooks would go on updating it at every backward, beside this optimizer's "
                                 "steps. close() that optimizer first")
        if claimant is not None:
            for key in [k for k, (held, owner) in _updaters.items() if held() is None or owner() is None]:
                del _updaters[key]  # (parameters or optimizers freed since)
            for p in gpu:
                _updaters[id(p)] = (weakref.ref(p), weakref.ref(claimant))


class GpuInBackward:
    def __init__(self, step_params, copied_as):
        self._step = HeldStep(step_params, self._dropped)  # the optimizer's (params, copies) -> steps params,
        # queuing their copies on `copies`
        self._copied_as = copied_as      # p -> (weak ref to the gradient copied in backward, its version then)
        self.state = {}                  # the optimizer's state dict, once it has one: a parameter's step count
        self.lock = ForkAwareLock("this optimizer", IN_BACKWARD)  # (a fork child: see offloaded.OffloadedParams)
        self.ready = []        # parameters whose gradient copy is queued, in arrival order
        # p -> the gradient backward produced, from its hook until its update ran: the update uses it whatever the
        # caller does to p.grad meanwhile (p.grad = None or model.zero_grad() right after backward made the update
        # of each parameter depend on whether the worker had reached it yet)
        self.grads = {}
        self.handed = set()    # parameters handed to the worker since the last step() or zero_grad()
        self.stepped = {}      # p -> (weak ref to the gradient it was stepped with, its version then)
        self.copies = StepCopies(in_backward=True)
        self.worker = UpdateWorker(self.lock, "swapio-gpu-in-backward")
        self.backwards = set()  # graph tasks of the backwards running that handed gradients
        self.released = False   # closed: its parameters may be given to another optimizer (check_unclaimed)
        self.abandoned = False  # a backward that handed gradients raised since the last step() or zero_grad()
        self.answered = False   # step() (or a load) was called since the last gradient handed over

    def check_fresh(self, p):
        """From GradCopies' hook, before p's gradient is copied: a second gradient of p before step() (a second
        backward, retain_graph=True) is refused, as for offloaded weights (torch would step once with the sum;
        its copy would also overwrite the one the worker may still read)."""
        with self.lock:
            if p in self.handed:
                self.answered = True  # (its error names the way on: zero_grad())
                raise second_backward_error("a parameter on a GPU got a gradient")

    def gradient_ready(self, p):
        """From GradCopies' hook (the backward thread)."""
        self._step.hold_for_backward()  # its updates are part of this backward: dropping the optimizer stops none
        self.raise_error()
        task = torch._C._current_graph_task_id()
        with self.lock:
            first = task >= 0 and task not in self.backwards
            if first:
                self.backwards.add(task)
            self.ready.append(p)
            try:
                self.worker.start(self._work, keep=self._step())  # the optimizer lives until the run returns
            except BaseException:  # no thread (the thread limit): p.grad stays for step(), as in_backward=False
                self.ready.remove(p)
                if first:
                    self.backwards.discard(task)
                raise
            self.handed.add(p)
            self.grads[p] = p.grad
            self.answered = False
        if first:
            on_backward_end(self.backward_ended, task)

    def backward_ended(self, task, ended):
        """A backward that handed gradients ended, or raised: then the updates it handed over end before its error
        reaches the caller, as torch's optimizer-in-backward hooks have (they use the options of then, not those
        the caller sets next), and as for offloaded weights (OffloadedParams.backward_abandoned)."""
        with self.lock:
            self.backwards.discard(task)
            self.abandoned = self.abandoned or not ended
        if not ended:
            with DeferredSigint():  # (in autograd's finalizer, where a second Ctrl-C could only be printed)
                self.worker.idle()

    def _work(self):
        while True:
            with self.lock:
                batch, self.ready = self.ready, []
                if not batch:
                    self.worker.working = None
                    return
            used = {p: self._copied_as(p) for p in batch}  # the gradients as backward produced them
            counts = {p: self._count(p) for p in batch}
            try:
                self._step_params(batch, self.copies)
                self.stepped.update((p, u) for p, u in used.items() if u is not None)
            except BaseException as exc:  # noqa: BLE001 - raised by the next gradient_ready() or finish()
                # those of the batch stepped before the error are stepped: step() must not step them again
                self.stepped.update((p, u) for p, u in used.items() if u is not None and self._count(p) != counts[p])
                self.worker.keep_error(exc)
            finally:
                with self.lock:
                    for p in batch:
                        self.grads.pop(p, None)

    def gradient_of(self, p):
        """The gradient backward produced for p (the worker's updates use it), or None."""
        with self.lock:
            return self.grads.get(p)

    def _step_params(self, params, copies):
        self._step()(params, copies)

    def _count(self, p):
        step = self.state.get(p, {}).get("step")
        return None if step is None else float(step)

    def raise_error(self):
        self.worker.raise_error()

    def idle(self):
        """Waits for the worker; an error of its stays for step() (or the next gradient) to report."""
        self.worker.idle()

    def wait(self):
        self.worker.wait()

    def finish(self):
        """step(): waits for the worker; returns the parameters it stepped (step() skips them), after checking
        that their gradients did not change since; the compute streams then wait for the copies."""
        try:
            self.wait()
            self.handed, self.abandoned = set(), False
            stepped, self.stepped = self.stepped, {}
            for p, (ref, version) in stepped.items():
                g = shard(p.grad) if p.grad is not None else None
                if g is None:  # torch's step() would leave p as it was; its update ran in backward
                    raise RuntimeError("a gradient was dropped (p.grad = None, model.zero_grad()) after "
                                       "in_backward=True had already used it to update its parameter during "
                                       "backward: torch's step() would skip that parameter, but its update has run. "
                                       "To decide after backward which parameters step, build the optimizer with "
                                       "in_backward=False")
                if ref() is not g or g._version != version:
                    raise RuntimeError("a gradient changed after in_backward=True had already used it to update its "
                                       "parameter during backward (torch.nn.utils.clip_grad_norm_, "
                                       "GradScaler.unscale_, an edit in place): that change cannot take effect. To "
                                       "clip or unscale, build the optimizer with in_backward=False")
            return set(stepped)
        finally:
            self.copies.end()

    def forget(self):
        """zero_grad(): whatever backward stepped is history. Returns whether a backward that ended (not one that
        raised) had updated parameters since the last step(): a step skipped after backward, which cannot be."""
        self.wait()
        unstepped = bool(self.stepped) and not self.abandoned and not self.answered
        self.stepped, self.handed, self.grads, self.abandoned, self.answered = {}, set(), {}, False, False
        self.copies.end()
        return unstepped

    def _dropped(self):
        """The optimizer was freed without close() (never while its work is in flight: see HeldStep)."""
        self.copies.end()  # as step() does: the compute streams wait for the new values
        error = self.worker.take_error()
        if error is not None:
            warnings.warn(f"an update of GPU parameters during backward (in_backward=True) failed after the optimizer "
                          f"was dropped: {error!r}; the parameters it had not reached keep their old values. Keep a "
                          "reference to the optimizer and call step() after each backward (it raises such an error, "
                          "then updates what is left)", SwapioWarning, stacklevel=2)

    def close(self):
        self.released = True
        with _updaters_lock:
            for key in [k for k, (_, owner) in _updaters.items() if owner() in (self, None)]:
                del _updaters[key]
        try:
            self.worker.close()
        finally:  # (as OffloadedParams.close)
            self.copies.end()
