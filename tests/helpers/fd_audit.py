"""File descriptors under hostile interruptions: an exception raised before any chosen bytecode (as a signal
handler's exception lands), and an audit of every descriptor Python code opens and closes.

InterruptAt: sys.settrace with opcode events in the chosen functions (this thread only: helper threads run
untraced, as they never receive Python signal handlers) raises Interrupt at the at-th point where CPython would
run a pending signal handler there: entering the function, right after a call returned (before its result is
stored) and at a loop's back edge. sweep() tries each point in turn.

FdAudit wraps os.open and os.close: a close of a descriptor that Python code does not hold (neither opened
during the audit nor open when it began; closed already: a second close, which would close whatever file took
the number meanwhile), a close that fails with EBADF, an EBADF
from a helper thread or a finalizer, and (at the end) a descriptor still open on the file it was opened on (a
leak) are each recorded as a problem.
"""
import dis
import errno
import gc
import inspect
import os
import sys
import threading
import types

import pytest


class Interrupt(BaseException):
    """What the injected 'signal handler' raises (a BaseException, as KeyboardInterrupt is)."""


def code_objects(*owners, exclude=()):
    """The code objects of the functions in modules / classes / functions `owners` (methods, nested functions
    and lambdas included), but those named in `exclude` (qualified names, e.g. "OwnedFd.__del__")."""
    found, seen = set(), set()

    def add_code(code):
        if code in found or code.co_qualname in exclude:
            return
        found.add(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                add_code(const)

    def add(obj, module):
        if (id(obj), module) in seen or isinstance(obj, types.ModuleType):  # (a module's imports are not its code)
            return
        seen.add((id(obj), module))
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    add(f, module)
        elif isinstance(obj, types.FunctionType):
            obj = inspect.unwrap(obj)  # (a @contextmanager's generator function)
            if obj.__module__ == module:
                add_code(obj.__code__)
        elif isinstance(obj, type):
            if obj.__module__ == module:
                for v in vars(obj).values():
                    add(v, module)

    for owner in owners:
        if isinstance(owner, types.ModuleType):
            for v in vars(owner).values():
                add(v, owner.__name__)
        else:
            add(owner, owner.__module__)
    return found


# Where CPython (3.11) runs a pending signal handler in a frame: on entering it (RESUME: a call, a generator
# resumed), after a call returned (the result not yet stored) and at a loop's back edge.
_CHECKS_AFTER = {dis.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD") if name in dis.opmap}


# Every trace function installed, kept for the life of the process: CPython 3.11 rarely called one after it was
# freed (helpers/isolated.py), so none is ever freed.
_kept = []


class InterruptAt:
    """`with InterruptAt(codes, at):` raises Interrupt at the at-th point (0-based) where a signal handler could
    run in code objects `codes` on this thread (_CHECKS_AFTER); .fired tells whether it did (False: the block
    passed fewer such points)."""

    def __init__(self, codes, at):
        self.codes, self.at, self.count, self.fired = codes, at, 0, False
        self._tracer = self._global  # one object for settrace, also held here (see _kept)
        _kept.append(self._tracer)

    def _global(self, frame, event, arg):
        if event != "call" or frame.f_code not in self.codes or self.fired:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        previous = [None]  # the last bytecode this activation ran; None: just entered

        def local(frame, event, arg):
            if event == "opcode" and not self.fired:
                before, previous[0] = previous[0], frame.f_code.co_code[frame.f_lasti]
                if before is None or before in _CHECKS_AFTER:
                    self.count += 1
                    if self.count - 1 == self.at:
                        self.fired = True
                        sys.settrace(None)
                        raise Interrupt()
            return local
        _kept.append(local)
        return local

    def __enter__(self):
        sys.settrace(self._tracer)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        return False


def sweep(operation, codes, after_each=None, limit=3000):
    """Runs operation() once interrupted before each bytecode in `codes` in turn (0, 1, 2, ...), then once
    through; after_each() after every run. Returns how many interrupted runs there were. AssertionError past
    `limit` runs (an operation whose points keep growing: what interrupted runs left behind, say)."""
    for at in range(limit):
        injector = InterruptAt(codes, at)
        try:
            with injector:
                operation()
        except Interrupt:
            pass
        if after_each is not None:
            after_each()
        if not injector.fired:
            return at
    raise AssertionError(f"operation still ran past {limit} bytecodes")


class FdAudit:
    """`with FdAudit() as audit:` records the problems of the descriptors opened and closed by os.open / os.close
    (see the module) in audit.problems; audit.leaks() lists the descriptors still open on their files."""

    def __init__(self):
        self._mp = pytest.MonkeyPatch()
        self._lock = threading.Lock()
        self.live = {}  # fd -> (st_dev, st_ino) of the file it was opened on
        self.problems = []
        self.opened = 0

    def __enter__(self):
        gc.collect()  # what earlier code left for the collector closes its descriptors now, not during the audit
        self.before = {int(n) for n in os.listdir("/proc/self/fd")}  # open already: closing one is no problem
        real_open, real_close = os.open, os.close

        def audited_open(*args, **kwargs):
            fd = real_open(*args, **kwargs)
            st = os.fstat(fd)
            with self._lock:
                self.live[fd] = (st.st_dev, st.st_ino)
                self.opened += 1
            return fd

        def audited_close(fd):
            with self._lock:
                owned = self.live.pop(fd, None) is not None or fd in self.before
                self.before.discard(fd)
            if not owned:
                self.problems.append(f"os.close({fd}) of a descriptor no Python code holds (closed already?) "
                                     f"on {threading.current_thread().name}")
            try:
                real_close(fd)
            except OSError as exc:
                if exc.errno == errno.EBADF:
                    self.problems.append(f"os.close({fd}): EBADF on {threading.current_thread().name}")
                raise

        def thread_error(args):
            self.problems.append(f"thread {args.thread.name if args.thread else '?'} raised {args.exc_value!r}")

        def unraisable(args):
            if isinstance(args.exc_value, OSError) and args.exc_value.errno == errno.EBADF:
                self.problems.append(f"EBADF in a finalizer: {args.exc_value!r} ({args.object!r})")

        self._mp.setattr(os, "open", audited_open)
        self._mp.setattr(os, "close", audited_close)
        self._mp.setattr(threading, "excepthook", thread_error)
        self._mp.setattr(sys, "unraisablehook", unraisable)
        return self

    def __exit__(self, *exc):
        self._mp.undo()
        return False

    def leaks(self):
        """The recorded descriptors still open on the file they were opened on."""
        left = []
        with self._lock:
            live = dict(self.live)
        for fd, ident in live.items():
            try:
                st = os.fstat(fd)
            except OSError:
                continue  # closed by something else (a file object that took it over)
            if (st.st_dev, st.st_ino) == ident:
                left.append(fd)
        return left


def settle_unlinks(errors):
    """An after_each for sweep(): waits for the commits' unlink helpers, recording (not raising) what they raise,
    so that the test asserts on every interrupted point's errors at the end."""
    from swapio.safetensors import commit

    def settle():
        try:
            commit.wait_for_unlinks()
        except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
            errors.append(repr(exc))
    return settle
