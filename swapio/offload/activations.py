"""Activation offload: the tensors autograd saves for backward go to pinned RAM or NVMe during the forward and
come back, read ahead in reverse order, during the backward (activation_store.py has the data path).

    act = offload_activations(to="nvme", swap_dir="/nvme/a", model=model)   # reusable; or inline in `with`
    with act:
        loss = model(batch).loss
    loss.backward()

enable_activation_offload(model, ...) wraps the model's forward in the same context, for training loops that
call the model themselves (transformers' Trainer, accelerate). The hooks are torch's saved_tensors_hooks; inside
a module of a swapio-offloaded model, swapio's hooks for offloaded weights sit on top of these and hand them every
saved tensor that is not a weight, so both work in one step.
"""
import inspect
import os
import threading
import types
import warnings
import weakref

import torch

from ..core import _swapdir
from ..core._fork_lock import ForkAwareLock
from ..core._errors import SwapioWarning, caller_stacklevel, check_int
from ..core._signals import DeferredSigint
from ..core.handle import _CONFIG_KEYS as IO_SETTINGS, AioHandle, check_moves_data
from ..core.pinned import PinnedPool, size_class
from .activation_blocks import ReadBlocks
from . import activation_store
from .activation_store import Session
from .compiled import methods_run_eagerly
from .kept import Kept

DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_STAGING_BYTES = 256 << 20
_ATTR = "_swapio_activation_offload"
# dynamo compiled the offload's bookkeeping when it ran inside a compiled region (a `with` in a compiled function,
# the forward of enable_activation_offload, the hooks called from a graph break): the hooks stayed pushed after
# the `with`, and every later saved tensor went to a finished forward's session
_EAGER = ("swapio's activation offload enters, leaves and moves saved tensors in Python, outside compiled graphs; "
          "compile without fullgraph=True (the graph breaks around the `with` block)")


class _Resources:
    """What the sessions of one ActivationOffload share: settings, the swap directory and handle (to="nvme"),
    the pinned pool, statistics. Outlives the ActivationOffload while saved tensors still need it."""

    def __init__(self, to, swap_dir, model, min_bytes, prefetch, staging_bytes, io_kwargs):
        self.to, self.min_bytes, self.prefetch, self.staging_bytes = to, min_bytes, prefetch, staging_bytes
        self.model_ref = None if model is None else weakref.ref(model)
        # (a fork child is refused it if another thread held it at the fork: see _fork_lock)
        self.lock = ForkAwareLock("this ActivationOffload", "a forward or backward saving or reading activations")
        self.pid = os.getpid()  # a fork child's copy leaves the swap directory and the sessions' files alone
        self.pool = PinnedPool(size_class)  # saved tensors of many nearby sizes, step after step
        self.read_blocks = ReadBlocks()     # what CPU tensors are read back into (to="nvme")
        self.file_hint = 0                  # the largest swap file a forward needed: reserved at once
        self.sessions = set()
        self.sessions_made = 0
        self.excluded = frozenset()
        self.cpu_kept = self.warned_cpu = False  # to="cpu" kept CPU tensors; said so
        self.stats = dict.fromkeys(("tensors", "bytes", "shared_views", "read_bytes", "unpack_misses",
                                    "peak_staged_bytes", "forward_wait_s", "backward_wait_s"), 0)
        self.owner = self.handle = self.directory = None
        if to == "nvme":
            _swapdir.make_parent(swap_dir)  # (made once all arguments passed their checks) as the optimizers do
            _swapdir.warn_if_ram_backed(os.path.abspath(swap_dir), "swap_dir")
            self.owner = _swapdir.private_directory(swap_dir)  # removes those of processes that died
            self.directory = self.owner.directory
            try:
                self.handle = AioHandle(**io_kwargs)
                check_moves_data(self.handle, "offload_activations")
            except BaseException:
                if self.handle is not None:
                    self.handle.close()
                self.owner.remove_everything()
                raise
        self._finalizer = weakref.finalize(self, _close, self.owner, self.handle, self.pool, self.read_blocks,
                                           self.pid)

    def note_model(self):
        """Storages of the model's parameters and buffers, which are never offloaded (read at each forward:
        .to() and loading replace them)."""
        model = None if self.model_ref is None else self.model_ref()
        if model is None:
            return
        ptrs = set()
        for t in (*model.parameters(), *model.buffers()):
            if (activation_store.on_gpu(t) or t.device.type not in ("meta", "cpu")
                    or (t.device.type == "cpu" and self.to == "nvme")):
                try:
                    ptrs.add(t.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    pass
        self.excluded = frozenset(ptrs)

    def wanted(self, t):
        """Whether a saved tensor is offloaded: a plain dense tensor on a device this mode moves, of at least
        min_bytes of storage, not a parameter (nor a view of one), not a buffer of the model."""
        if (type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_conj()
                or t.is_neg()):  # (a strided nested tensor has no sizes to rebuild it from)
            return False
        kind = "cuda" if activation_store.on_gpu(t) else t.device.type
        if kind not in ("cuda", "cpu"):
            return False
        base = t._base
        if base is None and t.requires_grad and t.is_leaf:  # a parameter in all but name
            return False
        if base is not None and (isinstance(base, torch.nn.Parameter) or (base.requires_grad and base.is_leaf)):
            return False
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return False
        nbytes = storage.nbytes()
        if not (nbytes > 0 and nbytes >= self.min_bytes and storage.data_ptr() not in self.excluded):
            return False
        if kind == "cpu" and self.to == "cpu":  # in RAM already: stays
            self.cpu_kept = True
            return False
        return True

    def warn_if_nothing_moved(self):
        """Once, after a forward: to="cpu" has moved nothing (a model that computes on the CPU, whose activations
        are in RAM already) though it kept CPU tensors it would otherwise have taken. Silently doing nothing would
        let a user believe RAM was saved."""
        if self.cpu_kept and not self.warned_cpu and self.stats["tensors"] == 0:
            self.warned_cpu = True
            warnings.warn('offload_activations(to="cpu") leaves CPU tensors where they are (in RAM already), so this '
                          "forward on the CPU offloaded nothing; to take activations out of RAM, use to=\"nvme\" "
                          "with a swap_dir on a disk", SwapioWarning, stacklevel=caller_stacklevel())

    def close(self):
        with DeferredSigint():  # every session and then the finalizer (which runs once), whole; then a Ctrl-C
            if os.getpid() == self.pid:
                with self.lock:
                    for session in list(self.sessions):
                        session.abort()
            # (a fork child: the sessions, their files and transfers, are the parent's; to="nvme" refused it any
            # of its own, to="cpu" keeps its own memory until its graphs go)
            self._finalizer()

    def check_process(self):
        """RuntimeError in a fork child of the process that made a to="nvme" offload: its directory is the
        parent's (the child's files there would collide with the parent's, and its close() remove them)."""
        if self.to == "nvme" and os.getpid() != self.pid:
            raise RuntimeError(
                f"this ActivationOffload(to=\"nvme\") was made in process {self.pid}, and this is a child forked from "
                "it (os.fork, a DataLoader worker, a multiprocessing pool): its swap directory and I/O handle are "
                "the parent's. Make another with offload_activations in the child")


def _close(owner, handle, pool, read_blocks, pid):
    # runs once (a finalizer): a Ctrl-C is raised when all of it is done, never left half done for good
    if os.getpid() != pid:
        return  # a fork child's copy (its exit runs this too): the directory and handle are the parent's, and the
        # pools' locks may have been held by another thread of the parent at the fork; the memory goes with it
    with DeferredSigint():
        try:
            if handle is not None:
                handle.close()
        finally:
            pool.clear()
            read_blocks.clear(closing=True)
            if owner is not None:
                owner.remove_everything()


@methods_run_eagerly("pack", "unpack", reason=_EAGER)
class _Hooks:
    """One pushed pair of saved-tensor hooks: a session's pack and unpack."""
    __slots__ = ("session", "pushed")

    def __init__(self, session):
        self.session = session
        # the very objects pushed, to find them on top again: `self.pack` read at the `with`'s end is another
        # function when torch._dynamo was first imported inside the block (a meta-device op, a first
        # torch.compile), which wraps these methods in torch.compiler.disable
        self.pushed = (self.pack, self.unpack)

    def pack(self, t):
        return self.session.pack(t)

    def unpack(self, saved):
        session = saved.session
        try:
            if isinstance(saved, Kept):  # a tensor pack left where it was
                return saved.unpack()
            if session is None:
                raise RuntimeError("this saved activation was already released by autograd")
            return session.unpack(saved)
        except BaseException as exc:
            if session is not None and (isinstance(exc, KeyboardInterrupt)
                                        or torch._C._current_graph_task_id() != -1):
                self._discard(session)
            raise

    def _discard(self, session):
        """A backward failed in an unpack of `session` (or was interrupted): its saved activations go now. Once an
        exception came out of an unpack hook, torch never frees what the nodes it had not run yet saved (the
        graph dropped, they stay), so waiting for the graph to go kept the swap file and memory until close().
        A `with` still open goes on with a fresh session."""
        reopen = session is self.session and session.open
        try:
            session.abort()
        finally:  # (abort() raises a Ctrl-C it deferred after cleaning up: the `with` still goes on)
            if reopen:
                self.session = _new_session(session.res)


def _new_session(res):
    with res.lock:
        res.sessions_made += 1
        session = Session(res, res.sessions_made)
        res.sessions.add(session)
    return session


class _Stack(threading.local):
    def __init__(self):
        self.entered = []  # (hooks, session) of this thread's open `with`s, innermost last


@methods_run_eagerly("__enter__", "__exit__", reason=_EAGER)
class ActivationOffload:
    """Saved activations to pinned RAM (to="cpu") or a swap directory (to="nvme"); see offload_activations.

    A context manager that can be entered again and again (each forward its own `with`), also from several
    threads. close() removes its swap directory and frees its pinned memory at once; without it, both go when
    this object and every graph it saved tensors for are gone.
    """

    def __init__(self, res):
        self._res = res
        self._stack = _Stack()

    @property
    def to(self):
        return self._res.to

    @property
    def directory(self):
        """The private swap directory (to="nvme"), removed at close."""
        return self._res.directory

    def stats(self):
        """Counters since creation: tensors (storages offloaded), bytes, shared_views (saves that reused an
        offloaded storage), read_bytes, unpack_misses (unpacks that found nothing read ahead), peak_staged_bytes,
        forward_wait_s (the forward waiting for staging room), backward_wait_s; and held now: pinned_bytes,
        read_buffer_bytes (what CPU tensors were read back into, kept for the next backward's reads)."""
        res = self._res
        with res.lock:
            return {**res.stats, "pinned_bytes": res.pool.in_use + res.pool.cached,
                    "read_buffer_bytes": res.read_blocks.in_use + res.read_blocks.cached,
                    "live_sessions": len(res.sessions)}

    def __enter__(self):
        res = self._res
        if res._finalizer.alive is False:
            raise RuntimeError("this ActivationOffload was closed; make a new one")
        res.check_process()
        session = _new_session(res)
        hooks = _Hooks(session)
        entered = self._stack.entered
        entered.append((hooks, session))
        try:
            res.note_model()
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks.pushed)
        except BaseException:
            self._leave(hooks, session, failed=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        entered = self._stack.entered
        if not entered:
            # torch's saved-tensor hooks are per thread: those pushed by the __enter__ of another thread stay on there
            # (its later saves kept going to a forward that never ended), and nothing of this thread's is to pop
            raise RuntimeError("an ActivationOffload's `with` block ended in a thread that did not enter it (or ended "
                               "twice): enter and leave it in the same thread")
        hooks, _ = entered[-1]
        # (a generator closed while suspended in the block ends it with GeneratorExit: no failure, what its forwards
        # made is the consumer's to run backward)
        failed = exc_type is not None and not issubclass(exc_type, GeneratorExit)
        self._leave(hooks, hooks.session, failed=failed)  # (a failed backward renews the session)

    def _leave(self, hooks, session, failed):
        """Takes the hooks off (if they are on top: an interrupt may have come before the push), then ends the
        session: a failed forward's activations are discarded at once."""
        entered = self._stack.entered
        if entered and entered[-1][0] is hooks:
            entered.pop()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        on_top = top is not None and top[0] is hooks.pushed[0] and top[1] is hooks.pushed[1]
        if on_top:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if failed:
            session.abort()
            return
        session.close_forward()
        self._res.warn_if_nothing_moved()
        if not on_top:  # torch can only pop the top: ours stay under the others (a later save there raises)
            raise RuntimeError(
                "offload_activations' `with` block ended while saved-tensor hooks pushed inside it (a "
                "torch.autograd.graph.saved_tensors_hooks or save_on_cpu context entered in the block) were "
                "still pushed; exit contexts in the reverse order of entering them")

    def close(self):
        """Discards every saved activation still held (their graphs can no longer run backward), removes the swap
        directory and frees the pinned memory. Idempotent."""
        self._res.close()

    def __repr__(self):
        where = f" in {self._res.directory}" if self._res.directory else ""
        return f"<swapio ActivationOffload to={self._res.to!r}{where}>"

    def __reduce_ex__(self, protocol):  # (copy and deepcopy come here too)
        # (pickle's own error named a lock): a copy would share the original's swap directory and sessions
        raise TypeError("an ActivationOffload cannot be copied or pickled (copy, deepcopy, pickle, torch.save): make "
                        "another with offload_activations")


def offload_activations(to="cpu", *, swap_dir=None, model=None, min_bytes=DEFAULT_MIN_BYTES, prefetch=4,
                        staging_bytes=DEFAULT_STAGING_BYTES, **io_kwargs):
    """An ActivationOffload: in its `with` block, the tensors autograd saves for backward are moved out.

    to="cpu": tensors on a GPU are copied to pinned RAM on a side stream (CPU tensors stay where they are);
    to="nvme": they go to a private directory under swap_dir (CPU tensors from their own memory, GPU tensors
    through pinned RAM), with at most staging_bytes held (in flight, or CPU tensors kept for the backward).
    min_bytes: smaller storages stay. prefetch: the tensors brought back ahead of backward's need (those still
    in RAM do not count). model: its parameters and buffers are never offloaded (parameters never are,
    whether given or not). io_kwargs: AioHandle settings (block_size, queue_depth, threads, engine, direct).
    """
    if to not in ("cpu", "nvme"):
        raise ValueError(f'to must be "cpu" or "nvme", got {to!r}')
    if to == "nvme":
        if swap_dir is None:
            raise ValueError('to="nvme" needs swap_dir, a directory on the disk that takes the activations')
        if not isinstance(swap_dir, (str, bytes, os.PathLike)):
            raise TypeError(f"swap_dir must be a path (str, bytes or os.PathLike), got {type(swap_dir).__name__}")
        unknown = sorted(set(io_kwargs) - set(IO_SETTINGS))
        if unknown:
            raise TypeError(f"offload_activations got unexpected arguments {unknown}; its AioHandle settings are "
                            f"{list(IO_SETTINGS)}")
        if isinstance(io_kwargs.get("engine", "auto"), str):  # (before swap_dir is made; "auto": SWAPIO_ENGINE's)
            check_moves_data(io_kwargs.get("engine", "auto"), "offload_activations")
        swap_dir = os.fsdecode(swap_dir)  # (a bytes path too: the swap files get str names)
        if os.path.lexists(swap_dir) and not os.path.isdir(swap_dir):
            raise ValueError(f"swap_dir {swap_dir!r} is not a directory")
    elif swap_dir is not None:
        raise ValueError('swap_dir is for to="nvme"; to="cpu" keeps the activations in pinned RAM')
    elif io_kwargs:
        raise TypeError(f'to="cpu" does no file I/O: unexpected arguments {sorted(io_kwargs)}')
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    min_bytes = check_int("min_bytes", min_bytes, 0)
    prefetch = check_int("prefetch", prefetch, 0)
    staging_bytes = check_int("staging_bytes", staging_bytes, 0)
    return ActivationOffload(_Resources(to, swap_dir, model, min_bytes, prefetch, staging_bytes, io_kwargs))


@methods_run_eagerly("__call__", reason=_EAGER, recursive=False)  # (the model's own forward compiles)
class _OffloadingForward:
    """A model's forward run inside its ActivationOffload (enable_activation_offload)."""

    def __init__(self, act, inner):
        self.act, self.inner = act, inner

    def __call__(self, *args, **kwargs):
        if self.act is None or not torch.is_grad_enabled():  # None: disabled, yet called by a wrapper over it
            return self.inner(*args, **kwargs)
        with self.act:
            return self.inner(*args, **kwargs)


class _Switch:
    """What enable_activation_offload keeps in the model's __dict__: the ActivationOffload and the forward the
    model had in its __dict__ before (None: its class's), and the forward it installed (`installed`, binding
    `call`)."""
    __slots__ = ("act", "own", "installed", "call")

    def __init__(self, act, own, installed, call):
        self.act, self.own, self.installed, self.call = act, own, installed, call

    def __reduce_ex__(self, protocol):
        # deepcopy (an EMA model), pickle, torch.save of the model object: pickle's own error named a lock
        raise TypeError("a model with activation offload enabled cannot be copied or pickled (copy.deepcopy, "
                        "pickle, torch.save of the model object): call disable_activation_offload(model) first, "
                        "copy it, and enable_activation_offload on each copy (torch.save(model.state_dict()) works "
                        "as it is)")


def _method(call):
    """A function to bind as model.forward, as accelerate expects of it: prepare() wraps its __func__ in autocast,
    and unwrap_model(keep_fp32_wrapper=False) binds the innermost function it finds (this one) back onto the model
    (bound, an object that is no function got the model as an extra argument). Its signature is the model's own
    forward's (Trainer reads it to pick the dataset's columns)."""
    def forward(self, *args, **kwargs):
        return call(*args, **kwargs)
    try:
        own = inspect.signature(call.inner)
        forward.__signature__ = own.replace(  # type: ignore[attr-defined]
            parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *own.parameters.values()])
    except (TypeError, ValueError):  # no signature to show: (*args, **kwargs)
        pass
    return forward


def enable_activation_offload(model, to="cpu", **kwargs):
    """Switches activation offload on for every forward of `model` with grad enabled (for training loops that
    call the model themselves: transformers' Trainer, accelerate). Takes offload_activations' arguments; returns
    the ActivationOffload. disable_activation_offload(model) switches it off again."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _ATTR in model.__dict__:
        raise RuntimeError("activation offload is already enabled on this model; call "
                           "disable_activation_offload(model) first")
    act = offload_activations(to, model=model, **kwargs)
    own = model.__dict__.get("forward")
    call = _OffloadingForward(act, model.forward)
    model.forward = types.MethodType(_method(call), model)
    model.__dict__[_ATTR] = _Switch(act, own, model.__dict__["forward"], call)
    return act


def disable_activation_offload(model):
    """Switches enable_activation_offload off: the model's forward as before, the ActivationOffload closed (so
    call it after the last backward)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    state = model.__dict__.pop(_ATTR, None)
    if state is None:
        return
    act, own = state.act, state.own
    state.call.act = None  # from now on it runs the model's forward as before
    if model.__dict__.get("forward") is not state.installed:
        pass  # wrapped again since (accelerate's prepare: autocast): that stays, and calls ours
    elif own is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = own
    act.close()
