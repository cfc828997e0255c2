"""The thread that runs optimizer updates during backward (in_backward=True), for offloaded weights
(offloaded.OffloadedParams) and for parameters on a GPU (gpu_in_backward.GpuInBackward).

Its owner hands it work under `lock` and start()s it; the run function loops until it finds nothing to do and
then sets `working` back to None under the same lock. An error is kept (the first) and raised once, on the user's
thread, by the next raise_error() or wait().
"""
from concurrent.futures import ThreadPoolExecutor


class UpdateWorker:
    def __init__(self, lock, name):
        self.lock, self.name = lock, name
        self.executor = None
        self.working = None  # the run's future while it runs
        self.error = None

    def start(self, run):
        """Starts run() on the worker thread unless it is running; the caller holds `lock`."""
        if self.working is None:
            if self.executor is None:
                self.executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            self.working = self.executor.submit(run)

    def keep_error(self, exc):
        """The run's error, kept for raise_error(); returns whether it is the first."""
        with self.lock:
            first = self.error is None
            if first:
                self.error = exc
        return first

    def raise_error(self):
        with self.lock:
            error, self.error = self.error, None
        if error is not None:
            raise error

    def idle(self):
        """Waits until the worker has nothing left to do; its error stays for raise_error()."""
        while True:
            with self.lock:
                working = self.working
            if working is None:
                return
            working.result()

    def wait(self):
        self.idle()
        self.raise_error()

    def close(self):
        """Waits for the worker (an error of its was the step's to report) and ends its thread."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - see above
            pass
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None


def second_backward_error(what):
    """The error of a gradient arriving for a parameter its in_backward update already stepped."""
    return RuntimeError(f"{what} after this backward already updated it (a second backward before step(), or "
                        "retain_graph=True): with in_backward=True every backward is one step, so call step() (and "
                        "zero_grad()) after each backward; to sum the gradients of several backward passes, build "
                        "the optimizer with in_backward=False")
