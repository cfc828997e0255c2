"""swapio.Future: one request, one future (concurrent.futures spelling: result(), done())."""
from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from typing import Any, Callable, List, NoReturn, Optional, Tuple

from ._errors import NotCopyable

_Outcome = Tuple[bool, Any]  # (True, value) or (False, exception)
_log = logging.getLogger("swapio")
_callbacks_lock = threading.Lock()


class _NotAConcurrentFuture(TypeError, AttributeError):
    """A TypeError for the caller; an AttributeError too, so hasattr() and introspection see no such attribute."""


class Future(NotCopyable):
    """The result of an async operation.

    ``wait()``/``result()`` return bytes moved for pread/pwrite and the tensor for swap_in, and raise
    ``OSError`` (errno, path, ``.offset``) when the I/O failed. Waiting releases the GIL.
    Dropping a future without waiting is safe: its handle keeps the memory alive until the I/O is done.
    """

    __slots__ = ("_request", "_then", "_undo", "_keepalive", "_lock", "_outcome", "observed", "_on_observed",
                 "_callbacks")

    def __init__(self, request: Any = None, then: Optional[Callable[[Any], Any]] = None, keepalive: Any = None,
                 undo: Optional[Callable[[BaseException], None]] = None,
                 on_observed: Optional[Callable[[Future], None]] = None) -> None:
        self._request = request      # native request, or None for an already-finished future
        self._then = then            # runs once on success: bytes moved -> the future's value
        self._undo = undo            # runs once when the future fails (also when `then` raised)
        self._keepalive = keepalive  # memory the native I/O is touching
        self._lock = threading.Lock()
        self._outcome: Optional[_Outcome] = None  # (True, value) or (False, exception)
        self.observed = False        # the caller has seen this future's outcome
        self._on_observed = on_observed  # called once with this future when its outcome is first seen
        self._callbacks: Optional[List[Callable[[Future], Any]]] = None  # add_done_callback's, while watched

    @classmethod
    def finished(cls, value: Any) -> Future:
        """A future that is already done, with `value` as its result."""
        f = cls()
        f._outcome = (True, value)
        return f

    def _chain(self, then: Callable[[Any], Any], undo: Optional[Callable[[BaseException], None]] = None) -> Future:
        """A future of the same request whose value is then(bytes moved); undo(exception) runs if it fails.
        Seeing its outcome counts as seeing this future's."""
        return Future(self._request, then=then, keepalive=self._keepalive, undo=undo, on_observed=self._observe)

    def done(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._outcome is not None or self._request is None or self._request.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Blocks until done (or ``timeout`` seconds: TimeoutError) and returns the value (bytes moved for
        pread/pwrite, the tensor for swap_in) or raises the operation's error (OSError for I/O)."""
        outcome = self._settle(timeout)
        self._observe()
        if outcome[0]:
            return outcome[1]
        raise outcome[1]

    result = wait

    def get(self, timeout: Optional[float] = None) -> Any:
        """kvikio's IOFuture spelling of wait() (a method, so subclasses' wait() applies)."""
        return self.wait(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Blocks like wait(), then returns the exception the operation raised, or None if it succeeded."""
        outcome = self._settle(timeout)
        self._observe()
        return None if outcome[0] else outcome[1]

    # concurrent.futures spellings. A submitted request cannot be called back: cancel() is always False, as for a
    # concurrent.futures.Future that is running.
    def cancel(self) -> bool:
        """Always False: the I/O was submitted to the kernel and cannot be called back."""
        return False

    def cancelled(self) -> bool:
        """Always False (see cancel())."""
        return False

    def running(self) -> bool:
        """True until the operation has finished."""
        return not self.done()

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Calls fn(future) once when the operation finishes: at once in this thread if it already has, else in a
        watcher thread. As in concurrent.futures, an exception fn raises is logged (logger "swapio") and ignored.
        Registering a callback does not count as seeing the outcome: an error fn does not take with
        result()/exception() is still raised by the handle's wait()."""
        if not callable(fn):
            raise TypeError(f"add_done_callback needs a callable, got {type(fn).__name__}")
        with _callbacks_lock:
            if self._callbacks is not None:  # the watcher holds it: it calls every callback in the list
                self._callbacks.append(fn)
                return
            if not self.done():
                self._callbacks = [fn]
                try:
                    _watcher.add(self)
                except RuntimeError:  # no watcher thread (the process's thread limit): fn is not registered
                    self._callbacks = None
                    raise
                return
        self._call_back(fn)

    def _run_callbacks(self) -> None:
        """(The watcher, once done() is True:) calls the callbacks registered; later ones run at once."""
        with _callbacks_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            self._call_back(fn)

    def _call_back(self, fn: Callable[[Future], Any]) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - as concurrent.futures does: a callback's error is not the operation's
            _log.exception("exception calling callback for %r", self)

    @property
    def _condition(self) -> NoReturn:
        # concurrent.futures.wait() and as_completed() reach into their own Future's internals (this attribute
        # first): say so, rather than an AttributeError
        raise _NotAConcurrentFuture("swapio futures cannot be passed to concurrent.futures.wait() or as_completed(): call "
                        "wait() on each (or AioHandle.wait()), or bridge them with add_done_callback (docs/io.md)")

    def _observe(self, _: object = None) -> None:
        """Marks the outcome as seen and tells whoever tracks this future (once), so it can be let go."""
        self.observed = True
        notify, self._on_observed = self._on_observed, None
        if notify is not None:
            notify(self)

    def _settle(self, timeout: Optional[float] = None) -> _Outcome:
        if self._outcome is None:
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
                raise TypeError(f"timeout must be None or a number of seconds, got {type(timeout).__name__}")
            if timeout is not None and not timeout >= 0:
                raise ValueError(f"timeout must be None or >= 0, got {timeout}")
            if timeout is not None and timeout > threading.TIMEOUT_MAX:  # (inf: threading's waits overflowed)
                timeout = None  # longer than the platform can wait: until done
            if not self._request.wait(timeout):
                raise TimeoutError(f"the operation did not finish within {timeout} s")
            with self._lock:
                if self._outcome is None:
                    try:
                        self._settle_from_request()
                    finally:
                        if self._outcome is not None:
                            self._keepalive = None
                            self._then = self._undo = None
        outcome = self._outcome
        assert outcome is not None  # (settled above, or what stopped it propagated)
        return outcome

    def _settle_from_request(self) -> None:
        """Sets the outcome of the finished request (under self._lock).

        Only an Exception is the operation's outcome. A KeyboardInterrupt or SystemExit raised meanwhile (a signal
        handler runs between any two bytecodes of the main thread) is the caller's and propagates at once, never
        kept to be returned by exception() or raised again by a later wait(). Landing before `then` started, it
        leaves the future unsettled: the next wait settles it from the request, whose result can be taken again.
        Landing inside `then`, it may have cut a step with side effects in half, which can neither be run again
        nor reported as done: the future fails with a RuntimeError saying so, and undo runs, as for any failure."""
        try:
            try:
                value = self._request.result()
            except Exception as exc:  # noqa: BLE001 - the operation's error, handed to the caller by wait()
                self._outcome = (False, exc)
                return
            try:
                self._outcome = (True, value if self._then is None else self._then(value))
            except Exception as exc:  # noqa: BLE001 - as above
                self._outcome = (False, exc)
            except BaseException as exc:
                # (one landing after the outcome was kept leaves it; without `then` nothing was done yet)
                if self._outcome is None and self._then is not None:
                    interrupted = RuntimeError(f"{type(exc).__name__} interrupted the step that completes this "
                                               "operation after its I/O finished: its result is unknown, do it "
                                               "again")
                    interrupted.__cause__ = exc
                    self._outcome = (False, interrupted)
                raise
        finally:
            undo, outcome = self._undo, self._outcome
            if undo is not None and outcome is not None and not outcome[0]:
                self._undo = None  # once
                undo(outcome[1])

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<swapio.Future {state}>"


class _CallbackWatcher:
    """One thread for the futures with callbacks pending (a thread each would be a thousand threads for a thousand
    reads bridged to concurrent.futures); it ends when none is left and starts again with the next."""

    def __init__(self) -> None:
        self._pending: List[Future] = []
        self._thread: Optional[threading.Thread] = None

    def add(self, future: Future) -> None:
        """(Under _callbacks_lock.)"""
        self._pending.append(future)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="swapio-future-callbacks", daemon=True)
            try:
                self._thread.start()
            except RuntimeError:  # refused by the system: kept, the thread that never ran blocked every later add
                self._thread = None
                self._pending.remove(future)
                raise

    def _run(self) -> None:
        while True:
            with _callbacks_lock:
                if not self._pending:
                    self._thread = None
                    return
                waiting = list(self._pending)
            finished = [f for f in waiting if f.done()]
            if finished:
                gone = {id(f) for f in finished}
                with _callbacks_lock:
                    self._pending = [f for f in self._pending if id(f) not in gone]
                for f in finished:
                    f._run_callbacks()
                continue
            request = waiting[0]._request
            if request is not None:  # a native wait releases the GIL and returns as soon as that request finishes
                request.wait(0.005)
            else:
                time.sleep(0.005)


    def after_fork_in_child(self) -> None:
        # the thread is not in the child (nor are the parent's requests)
        self._pending, self._thread = [], None


_watcher = _CallbackWatcher()
os.register_at_fork(after_in_child=_watcher.after_fork_in_child)
