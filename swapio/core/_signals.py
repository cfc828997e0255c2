"""Ctrl-C during an optimizer step takes effect only where the state is consistent.

Python runs a SIGINT handler between any two bytecodes of the main thread, so a KeyboardInterrupt could land
after the kernel has rewritten a parameter and its moments but before its step count is advanced (the next step
would then apply the same bias correction twice), or after a chunk of the nvme state was computed but before it
was written back. While a step runs, DeferredSigint records SIGINT instead; the state backend calls poll() at
each point where every parameter is either fully stepped or untouched (between parameters; in nvme mode at a
chunk boundary that no parameter spans, once the writes before it are on disk). poll() then runs the handler
that was in place (torch's default: KeyboardInterrupt), so Ctrl-C still stops a long step within about one
parameter. A handler that returns (a training loop's own "stop after this step" flag) lets the step go on.

Only the main thread receives Python signal handlers, so elsewhere this does nothing; neither does it where
SIGINT is ignored or has its default action (SIG_IGN / SIG_DFL: no Python code runs for it).
"""
import signal
import threading


class DeferredSigint:
    def __init__(self):
        self._handler = None  # the handler displaced while the step runs, or None
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
        if self.pending and exc_type is None:  # Ctrl-C after the last consistent point: the step is complete
            self.pending = False
            handler(signal.SIGINT, self._frame)
