"""Starting a thread with the caller's signals blocked, so that fewer land inside Thread.start().

A KeyboardInterrupt (or any signal handler's exception) raised while Thread.start() waits for the new thread to
run leaves that thread running with its starter unaware of it: a helper that copies into buffers the caller then
frees or reuses, or a writer never waited for. Blocking every signal on the calling thread for the duration of
start() makes a signal arrive right after it instead, once the caller holds the started thread (its try/finally
then joins or accounts for it. The new thread inherits the blocked mask, which suits a worker: Python runs
signal handlers on the main thread only. This narrows the window, it does not close it: a signal that another
thread's C handler catches still runs its Python handler on this thread at its next call.)"""
import signal
import threading


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

