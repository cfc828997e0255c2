"""ForkAwareLock: a reentrant lock around an object's state that a fork() child can still use, or is told why not.

fork() copies a lock held by another thread as held, and no thread of the child will ever release it: a child that
then takes it (a DataLoader worker, a multiprocessing pool started by fork, touching the parent's optimizer or
offloaded model) hung for good. If some thread other than the forking one held it at the fork, what it guarded
may be half-changed (a step or a forward in progress), so in the child the lock is made free again and entering
it raises `RuntimeError` naming that instead.

It is the C `RLock` itself (a subclass): taking it costs what an RLock does, which matters on paths that take it
hundreds of times per module (the offload's fetcher). Only a child's refused copy runs Python code.
"""
import _thread
import os
import weakref

_locks: "weakref.WeakSet[ForkAwareLock]" = weakref.WeakSet()


class ForkAwareLock(_thread.RLock):  # type: ignore[misc]  # (typeshed says final; CPython allows it)
    """`with lock:`, acquire() and release() of a threading.RLock (see the module); `what` names the guarded
    object in the child's error, `doing` what a thread may have been doing with it."""

    def __init__(self, what, doing="a step, state_dict(), save() or load()"):
        self.what, self.doing = what, doing
        _locks.add(self)

    def _after_fork_in_child(self):
        if self._is_owned():
            return  # taken by the thread that forked, which goes on in the child and releases it
        if self.acquire(blocking=False):  # nobody held it
            self.release()
            return
        self._at_fork_reinit()  # type: ignore[attr-defined]  # (free: the holder is not in this process)
        self.__class__ = _ForkedWhileHeld


class _ForkedWhileHeld(ForkAwareLock):  # type: ignore[misc]
    """A child's copy of a lock another thread of the parent held at the fork: refused."""

    def acquire(self, blocking=True, timeout=-1):
        raise RuntimeError(
            f"{self.what} was in use on another thread ({self.doing}) when this process was forked from it: its "
            "copy here may be half-changed. Build a new one in the child (or fork before using it, or while no "
            "other thread uses it)")

    __enter__ = acquire


def _reset_in_child():
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_in_child)
