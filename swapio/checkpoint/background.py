"""Background writes for async_save: one thread per save, each starting after the previous one finished, so
saves land in the order they were asked for. The threads are not daemons: an interpreter that exits (Ctrl-C
included) first finishes the saves already captured."""
import threading

from ..core.futures import Future

_lock = threading.Lock()
_last = None  # the _Job most recently submitted
QUEUED = 2  # captures held at once: the one being written and one waiting behind it
_slots = threading.BoundedSemaphore(QUEUED)


def reserve():
    """Blocks until a capture may be taken (fewer than QUEUED saves captured and unfinished); the slot is given
    back when the save submitted with it finishes, or by release() if none is submitted."""
    _slots.acquire()


def release():
    _slots.release()


class _Job:
    """A swapio.Future's request (done / wait / result) run on its own thread."""

    def __init__(self, fn, previous):
        self._fn, self._previous = fn, previous
        self._done = threading.Event()
        self._outcome = None
        self._thread = threading.Thread(target=self._run, name="swapio-checkpoint", daemon=False)

    def _run(self):
        try:
            if self._previous is not None:
                self._previous._done.wait()
                self._previous = None
            self._outcome = (True, self._fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by Future.wait()
            self._outcome = (False, exc)
        finally:
            self._fn = None
            self._done.set()
            _slots.release()  # (its capture is freed or kept for the next save: buffers.py)

    def done(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        return self._done.wait(timeout)

    def result(self):
        ok, value = self._outcome
        if ok:
            return value
        raise value


def submit(fn):
    """A swapio.Future of fn() run in the background after every earlier submit(); the caller reserve()d."""
    global _last
    with _lock:
        job = _Job(fn, _last)
        _last = job
        job._thread.start()
    return Future(job)


def wait_all():
    """Waits for every save submitted so far (errors stay with their futures)."""
    with _lock:
        job = _last
    if job is not None:
        job.wait()
