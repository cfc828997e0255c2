"""Background writes for async_save: one thread per save, each starting after the previous one finished, so
saves land in the order they were asked for. The threads are not daemons: an interpreter that exits (Ctrl-C
included) first finishes the saves already captured. A Ctrl-C while it waits for them at exit abandons those still
writing (see _abandon_at_ctrl_c).

A child forked while saves are in flight (DataLoader workers, multiprocessing pools) starts with none: the
parent's threads are not there to finish them, so their queue, slots and lock would block the child's first
save forever. Their futures tell a child that waits on them that the save is the parent's."""
import os
import sys
import threading

from ..core._signals import DeferredSigint, start_shielded, wait_at_exit
from ..core.futures import Future

_lock = threading.Lock()
_last = None  # the _Job most recently submitted
QUEUED = 2  # captures held at once: the one being written and one waiting behind it
_slots = threading.BoundedSemaphore(QUEUED)
_abandoned = threading.Event()  # a Ctrl-C at exit: the saves still writing stop and remove their temporary files


def abandoned():
    """Whether the saves still writing are to stop (their writers check this at each window)."""
    return _abandoned.is_set()


class Slot:
    """A capture's place among the QUEUED, once reserve() holds it: released once, by the save's job when it
    finishes, or by the caller when no job ran (an error or an interruption before or while submitting). The job
    marks it taken when it starts; an interruption that lands between starting the job's thread and that mark
    lets the caller release it early, never twice."""

    def __init__(self):
        self._lock = threading.Lock()
        self.taken = False   # by a running job
        self._held = False

    def reserve(self):
        """Blocks until a capture may be taken (fewer than QUEUED saves captured and unfinished), then holds the
        place. A Ctrl-C while waiting is raised within 0.05 s; one arriving as the place is taken, once this slot
        holds it, for the caller's release(): landing in between, it lost the place for good, and after QUEUED
        such interrupts every async_save waited forever."""
        while True:
            with DeferredSigint():
                if _slots.acquire(timeout=0.05):
                    self._held = True
                    return

    def release(self):
        with DeferredSigint():  # (a place let go of in the caller's thread: whole, see reserve)
            with self._lock:
                held, self._held = self._held, False
            if held:
                _slots.release()

    def release_unless_taken(self):
        if not self.taken:
            self.release()


class _Job:
    """A swapio.Future's request (done / wait / result) run on its own thread."""

    def __init__(self, fn, previous, slot):
        self._fn, self._previous, self._slot = fn, previous, slot
        self._pid = os.getpid()
        self._done = threading.Event()
        self._outcome = None
        self._thread = threading.Thread(target=self._run, name="swapio-checkpoint", daemon=False)

    def _run(self):
        self._slot.taken = True
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
            self._slot.release()  # (its capture is freed or kept for the next save: buffers.py)

    def _forked_away(self):
        """True in a forked child while the save is unfinished: the parent's thread writes it, not ours."""
        return os.getpid() != self._pid and self._outcome is None

    def done(self):
        return self._forked_away() or self._done.is_set()

    def wait(self, timeout=None):
        return self._forked_away() or self._done.wait(timeout)

    def result(self):
        if self._forked_away():
            raise RuntimeError("this async_save was submitted before fork() by the parent process, which writes and "
                               "waits for it; a forked child cannot (save again in the child if it needs the file)")
        ok, value = self._outcome
        if ok:
            return value
        raise value


def submit(fn, slot):
    """A swapio.Future of fn() run in the background after every earlier submit(); slot: the caller's reserved Slot.
    Raises RuntimeError, with nothing queued, when no thread can be started (the process's thread limit)."""
    global _last
    # a Ctrl-C lands once the job is both the last and started: one landing between the two left a last job whose
    # thread never ran, and every later save waited for it forever (the exit too). Raised then, the save goes on.
    # The job becomes the last once its thread runs: a start refused by the system left it last, never to finish.
    with DeferredSigint(), _lock:
        job = _Job(fn, _last, slot)
        start_shielded(job._thread)
        _last = job
    return Future(job)


def _forget_parents_saves():
    global _lock, _last, _slots
    _lock, _last, _slots = threading.Lock(), None, threading.BoundedSemaphore(QUEUED)


os.register_at_fork(after_in_child=_forget_parents_saves)


def wait_all():
    """Waits for every save submitted so far (errors stay with their futures)."""
    with _lock:
        job = _last
    if job is not None:
        job.wait()


def _abandon_at_ctrl_c():
    """A Ctrl-C while the exit waits for the writers: the saves still writing stop at their next window and remove
    their temporary files (the file at each path stays as it was), which takes at most a window's write."""
    if not _abandoned.is_set():
        _abandoned.set()
        sys.stderr.write("swapio: Ctrl-C at exit: abandoning the async_save still writing (the file at its "
                         "path stays as it was); waiting for its thread to remove its temporary file\n")


wait_at_exit(wait_all, _abandon_at_ctrl_c)
