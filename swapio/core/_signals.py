"""Signals around work that must not be cut in half: Ctrl-C deferred to consistent points (DeferredSigint), and
threads started with the caller's signals blocked (start_shielded).

DeferredSigint. Python runs a SIGINT handler between any two bytecodes of the main thread, so a KeyboardInterrupt
could land after the kernel has rewritten a parameter and its moments but before its step count is advanced (the
next step would then apply the same bias correction twice), or after a chunk of the nvme state was computed but
before it was written back, or between the renames that commit a checkpoint. Inside the context, SIGINT is
recorded instead; the code calls poll() at each point where its state is consistent (the optimizer's state
backends: between parameters; in nvme mode at a chunk boundary that no parameter spans, once the writes before it
are on disk). poll() then runs the handler that was in place (torch's default: KeyboardInterrupt), so Ctrl-C
still stops a long step within about one parameter. A handler that returns (a training loop's own "stop after
this step" flag) lets the work go on. Clean-ups that must run whole (removing a swap directory and letting go of
its lock, a finalizer's work, which runs only once) run inside it too, so a Ctrl-C is raised once they are done.
Only the main thread receives Python signal handlers, so elsewhere this
does nothing; neither does it where SIGINT is ignored or has its default action (SIG_IGN / SIG_DFL: no Python
code runs for it).

start_shielded. A KeyboardInterrupt (or any signal handler's exception) raised while Thread.start() waits for the
new thread to run leaves that thread running with its starter unaware of it: a helper that copies into buffers
the caller then frees or reuses, or a writer never waited for. Blocking every signal on the calling thread for
the duration of start() makes a signal arrive right after it instead, once the caller holds the started thread
(its try/finally then joins or accounts for it. The new thread inherits the blocked mask, which suits a worker:
Python runs signal handlers on the main thread only. This narrows the window, it does not close it: a signal
that another thread's C handler catches still runs its Python handler on this thread at its next call.)

wait_at_exit. Background threads that must finish their work (writers, update workers) are waited for as the
interpreter exits, before Python joins them: a Ctrl-C during Python's own join stopped that wait and finalized
the interpreter under the running threads (a traceback, at times an abort: "terminate called without an active
exception"), with their work half done.
"""
import atexit
import signal
import threading


class DeferredSigint:
    """`with DeferredSigint() as ctrl_c:` records SIGINT; ctrl_c.poll() at consistent points runs it (see the module)."""

    def __init__(self):
        self._handler = None  # the handler displaced while the context runs, or None
        self._frame = None
        self.pending = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            try:
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    signal.signal(signal.SIGINT, self._record)
                    self._handler = handler
            except ValueError:  # not the main interpreter
                pass
        return self

    def _record(self, signum, frame):
        self.pending, self._frame = True, frame

    def poll(self):
        """At a consistent point: runs the displaced handler for a SIGINT received since the last poll."""
        if self.pending:
            self.pending = False
            self._handler(signal.SIGINT, self._frame)

    def __exit__(self, exc_type, exc, tb):
        handler, self._handler = self._handler, None
        if handler is None:
            return
        signal.signal(signal.SIGINT, handler)
        # Ctrl-C after the last consistent point: the work is complete, or ended by an error, which the user's
        # Ctrl-C is raised in preference to (the error its __context__); never dropped for it
        if self.pending and (exc_type is None or issubclass(exc_type, Exception)):
            self.pending = False
            handler(signal.SIGINT, self._frame)


def start_shielded(thread: threading.Thread) -> None:
    """thread.start(), with the calling thread's signals blocked while it runs (see the module)."""
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def wait_at_exit(wait, on_ctrl_c):
    """Runs wait() as the interpreter exits, until it returns (see the module); each Ctrl-C meanwhile calls
    on_ctrl_c() (say what is waited for; abandon work that can be) and waits on. Registered before Python joins
    its threads (concurrent.futures' hook comes after it) and once more among the atexit functions: a Ctrl-C at
    the very start of the shutdown skips the first. An Exception from wait() ends the wait (its error was the
    program's to see)."""
    def run():
        while True:
            try:
                wait()
                return
            except KeyboardInterrupt:
                on_ctrl_c()
            except Exception:  # noqa: BLE001 - see above
                return
    threading._register_atexit(run)  # type: ignore[attr-defined]
    atexit.register(run)
