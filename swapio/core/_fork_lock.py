"""ForkAwareLock: a reentrant lock around an object's state that a fork() child can still use, or is told why not.

fork() copies a lock held by another thread as held, and no thread of the child will ever release it: a child that
then takes it (a DataLoader worker, a multiprocessing pool started by fork, touching the parent's optimizer or
offloaded model) hung for good. After a fork the child's copy is a new lock. If some thread held it at the fork,
what it guarded may be half-changed (a step or a forward in progress), so entering it in the child raises
`RuntimeError` naming that instead.
"""
import os
import threading
import weakref

_locks: "weakref.WeakSet[ForkAwareLock]" = weakref.WeakSet()


class ForkAwareLock:
    """`with lock:`, acquire() and release() as a threading.RLock (see the module); `what` names the guarded object
    in the child's error, `doing` what a thread may have been doing with it."""

    def __init__(self, what, doing="a step, state_dict(), save() or load()"):
        self.what, self.doing = what, doing
        self._lock = threading.RLock()
        self._depth = 0  # holds of the lock, changed only by its holder
        self._forked_while_held = False
        _locks.add(self)

    def acquire(self, blocking=True):
        if self._forked_while_held:
            raise RuntimeError(
                f"{self.what} was in use on another thread ({self.doing}) when this process was forked from it: its "
                "copy here may be half-changed. Build a new one in the child (or fork before using it, or while "
                "no other thread uses it)")
        if not self._lock.acquire(blocking):
            return False
        self._depth += 1
        return True

    def release(self):
        if self._depth:  # (0 in a child forked by the holder itself: the lock it took is gone)
            self._depth -= 1
            self._lock.release()

    def _is_owned(self):
        """Whether this thread holds the lock (threading.RLock's own test)."""
        return self._lock._is_owned()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def _after_fork_in_child(self):
        self._forked_while_held = self._depth > 0
        self._lock, self._depth = threading.RLock(), 0


def _reset_in_child():
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_in_child)
