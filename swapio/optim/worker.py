"""The thread that runs optimizer updates during backward (in_backward=True), for offloaded weights
(offloaded.OffloadedParams) and for parameters on a GPU (gpu_in_backward.GpuInBackward), and what keeps the
optimizer alive while that work is in flight (HeldStep).

Its owner hands it work under `lock` and start()s it; the run function loops until it finds nothing to do and
then sets `working` back to None under the same lock. An error is kept (the first) and raised once, on the user's
thread, by the next raise_error() or wait().

Lifetime. The update is part of backward, as with torch's optimizer-in-backward hooks (which hold their
optimizers): a backward that handed the optimizer a gradient keeps it alive until that backward ends, and each
run of the worker keeps it alive until the run returns, so the updates of a backward land exactly once even when
the program drops the optimizer right after (or during) it. At rest the optimizer is held weakly: the model's
hooks reach the worker, and an optimizer the program dropped must stop updating the model and free its files at
once. When it is freed, the owner's on_drop() reports what its last backward could not finish.

Fork. The worker thread is not in a forked child: work handed to the parent's executor there never ran, and the
child's next step() waited for it forever. The child starts a thread of its own; if the parent's was updating
weights at the fork, those may be half-updated in the child, which is refused (RuntimeError) instead.

Exit. The interpreter waits for the updates in flight (_wait_for_workers) before Python joins the executor's thread.
"""
import os
import sys
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ..core._signals import DeferredSigint, wait_at_exit


# what another thread may have been doing with an in_backward=True optimizer at a fork (ForkAwareLock's error)
IN_BACKWARD = "a backward handing it gradients, a step, or its in_backward worker updating weights"


class UpdateWorker:
    def __init__(self, lock, name):
        self.lock, self.name = lock, name
        self.executor = None
        self.working = None  # the run's future while it runs
        self.last = None     # the last run's future: done once that run has let go of what it kept alive
        self.error = None
        self.forked_busy = False  # a fork child of a process whose worker was running (see the module)
        _workers.add(self)

    def start(self, run, keep=None):
        """Starts run() on the worker thread unless it is running; the caller holds `lock`. keep: what the work
        needs alive (the optimizer's step), held until run() returns. When no thread can start, raises (Python's
        RuntimeError) with nothing queued: the caller takes back what it handed over."""
        self._refuse_if_forked_busy()
        if self.working is None:
            if self.executor is None:
                self.executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            try:
                self.working = self.last = self.executor.submit(_run, run, [keep])
            except BaseException:
                # no thread could start (the process's thread limit): submit() had queued the run all the same, and
                # the next submission's thread ran it late, with what the caller had rolled back by then. Dropped
                # with the executor; the next start() makes another.
                self.executor.shutdown(wait=False, cancel_futures=True)
                self.executor = None
                raise

    def keep_error(self, exc):
        """The run's error, kept for raise_error(); returns whether it is the first. Its frames' locals are dropped
        (the lines stay): kept, they would hold the optimizer, which must be freed when the program drops it."""
        _drop_locals(exc)
        with self.lock:
            first = self.error is None
            if first:
                self.error = exc
        return first

    def take_error(self):
        """The kept error (None if none), which is then no longer raised."""
        with self.lock:
            error, self.error = self.error, None
        return error

    def raise_error(self):
        error = self.take_error()
        if error is not None:
            raise error

    def idle(self):
        """Waits until the worker has nothing left to do and its last run has returned (an optimizer dropped
        meanwhile is freed by then); its error stays for raise_error()."""
        self._refuse_if_forked_busy()
        while True:
            with self.lock:
                working, last = self.working, self.last
            if working is None:
                if last is not None:
                    last.result()
                return
            working.result()

    def wait(self):
        self.idle()
        self.raise_error()

    def close(self):
        """Waits for the worker (an error of its was the step's to report) and ends its thread. It returns, or
        raises the user's Ctrl-C met while waiting, only once the thread has ended: the caller then frees what
        the run uses (a second Ctrl-C meanwhile is raised after it too)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - see above
            pass
        finally:
            if self.executor is not None:
                with DeferredSigint():
                    self.executor.shutdown(wait=True)
                self.executor = None

    def _refuse_if_forked_busy(self):
        if self.forked_busy:
            raise RuntimeError(
                "this optimizer's in_backward=True worker was updating weights when this process was forked from it "
                "(os.fork, a multiprocessing pool): the weights and optimizer state here may be half-updated. Build "
                "the model and optimizer anew in the child (or fork after step() returned)")

    def _after_fork_in_child(self):
        self.forked_busy = self.forked_busy or self.working is not None
        self.executor = self.working = self.last = None  # the parent's thread: a new one starts on demand


_workers: "weakref.WeakSet[UpdateWorker]" = weakref.WeakSet()


def _reset_in_child():
    for worker in list(_workers):
        worker._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_in_child)


def _wait_for_workers():
    """Waits until every worker is idle: what is left is at most the few batches of gradients a backward may run
    ahead of its worker. (Stopping at a Ctrl-C finalized the interpreter under a thread still updating.)"""
    for worker in list(_workers):
        try:
            worker.idle()
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - the run's error was the program's to see; a fork child's refusal
            continue


class _SayOnce:
    said = False

    def __call__(self):
        if not self.said:
            self.said = True
            sys.stderr.write("swapio: Ctrl-C at exit: waiting for the in_backward=True updates in flight (a "
                             "few batches at most) to finish\n")


wait_at_exit(_wait_for_workers, _SayOnce())


def _drop_locals(exc):
    todo, seen = [exc], set()
    while todo:
        exc = todo.pop()
        if exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            traceback.clear_frames(exc.__traceback__)  # (frames still running are left as they are)
            todo += [exc.__cause__, exc.__context__]


def _run(run, keep):
    try:
        run()
    finally:
        keep.clear()  # an optimizer the program dropped meanwhile is freed here, before the run's future is done


class HeldStep:
    """An optimizer's step method as its in_backward work holds it (see the module): weakly, except while a
    backward that handed it a gradient runs (hold_for_backward) and while the worker runs (UpdateWorker.start's
    keep: call this object for the method). on_drop (a bound method, held weakly) runs when the optimizer is freed
    by reference counting, which never happens while its work is in flight."""

    def __init__(self, method, on_drop):
        drop = weakref.WeakMethod(on_drop)
        self._ref = weakref.WeakMethod(method, lambda _: _call(drop))
        self._backward = None  # weak ref to the _BackwardHold of the backward that holds the optimizer now

    def __call__(self):
        """The step method (a strong reference to the optimizer)."""
        method = self._ref()
        if method is None:
            raise RuntimeError("the in_backward=True optimizer owning these parameters was dropped (garbage-collected) "
                               "before this gradient arrived: keep a reference to it while you train, and close() "
                               "it when done")
        return method

    def hold_for_backward(self):
        """From a gradient hook: the backward running keeps the optimizer alive until it ends (the engine's final
        callbacks hold it), so its later gradients still reach the optimizer if the program drops it meanwhile."""
        held = self._backward() if self._backward is not None else None
        if held is not None and held.method is not None:
            return
        held = _BackwardHold(self())
        try:
            torch.autograd.Variable._execution_engine.queue_callback(held.release)
        except RuntimeError:  # not called from a backward: none to hold it through
            return
        self._backward = weakref.ref(held)


class _BackwardHold:
    __slots__ = ("method", "__weakref__")

    def __init__(self, method):
        self.method = method

    def release(self):
        self.method = None


def _call(weak_method):
    method = weak_method()
    if method is not None:
        method()


def second_backward_error(what):
    """The error of a gradient arriving for a parameter its in_backward update already stepped."""
    return RuntimeError(f"{what} after this backward already updated it (a second backward before step(), "
                        "retain_graph=True, a backward that raised partway and was caught, or a weight used both "
                        "inside a reentrant activation checkpoint and elsewhere, whose checkpoint's own backward "
                        "completed it early): with in_backward=True every backward is one step, so call step() (and "
                        "zero_grad()) after each backward, and zero_grad() after catching a backward's error (what it "
                        "updated stays updated); checkpoint with use_reentrant=False; to sum the gradients of several "
                        "backward passes, build the optimizer with in_backward=False")
