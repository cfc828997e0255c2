"""AioHandle: async pread/pwrite of CPU tensors to files, one swapio.Future per call."""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, Optional, Tuple, Union

import torch

from .. import _C
from ._closeable import Closeable
from ._errors import NotCopyable, StrPath, check_bool, check_int, check_path, file_system_key, warn_once
from .futures import Future
from .pinned import is_pinned
from .tensors import check_writable_in_place, cpu_memory, mark_written

_PRUNE_MIN = 64
_CONFIG_KEYS = ("block_size", "queue_depth", "threads", "engine", "direct", "submit_batch")


def _remove_if_empty(path: str) -> None:
    try:
        if os.lstat(path).st_size == 0:
            os.unlink(path)
    except OSError:
        pass


def config_settings(config: Union[StrPath, Dict[str, Any]], name: str = "config") -> Dict[str, Any]:
    """The AioHandle settings of a dict or of a JSON file as written by `swapio tune` (its "handle" object, or the
    whole); TypeError/ValueError naming `name` or the file for a config that is neither, or has unknown keys."""
    source = "the config"
    if isinstance(config, dict):
        doc: Any = config
    else:
        source = check_path(name, config)
        with open(source) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source} is not valid JSON ({e}); `swapio tune` writes this file") from None
    settings: Any = doc.get("handle", doc) if isinstance(doc, dict) else doc
    if not isinstance(settings, dict):  # else an AttributeError or TypeError from deep inside
        raise ValueError(f"{source}: the AioHandle settings must be a JSON object (a dict) of "
                         f"{list(_CONFIG_KEYS)}, got {type(settings).__name__}")
    unknown = set(settings) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown AioHandle config keys: {sorted(unknown)} (known: {list(_CONFIG_KEYS)})")
    return dict(settings)


def check_moves_data(handle: Union[AioHandle, str, None], who: str) -> None:
    """ValueError for a handle (or an engine name; None: the default handle, engine="auto") that moves no data
    ("null": swapio's own overhead, for benchmarks): what `who` wrote would be lost and what it read garbage,
    silently. "auto" is what SWAPIO_ENGINE forces, as the handles made for it will open (null included)."""
    forced = os.environ.get("SWAPIO_ENGINE") or "auto"
    if handle is None or isinstance(handle, str):
        engine = forced if handle in (None, "auto") else handle
    else:
        engine = handle.engine
    if engine == "null":
        cause = " (SWAPIO_ENGINE=null in the environment makes engine='auto' open it: unset it)" \
            if forced == "null" else ""
        raise ValueError(f"{who} needs an AioHandle that moves data, but engine='null' moves none (it measures "
                         f"swapio's overhead in benchmarks){cause}; use engine='auto', 'uring', 'aio' or 'psync'")


class AioHandle(NotCopyable, Closeable):
    """Async O_DIRECT I/O between CPU tensors and files.

    block_size: bytes per I/O piece; queue_depth: pieces in flight per worker; threads: workers, each
    taking a contiguous stripe of a large request; engine: "auto" | "uring" | "aio" | "psync" | "null" (moves no
    data: benchmarks of swapio's overhead; SwapStore, checkpoints, offload and the optimizers refuse it);
    direct: None (O_DIRECT where the file system takes it, else buffered with a warning), True (O_DIRECT
    or an error), False (buffered); submit_batch: most pieces handed to the kernel per system call (fio's
    iodepth_batch_submit, default 1 as in fio; 0: all that are ready, fewer system calls).
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, threads: int = 1, engine: str = "auto",
                 direct: Optional[bool] = None, submit_batch: int = 1) -> None:
        block_size = check_int("block_size", block_size, 1)
        queue_depth = check_int("queue_depth", queue_depth, 1)
        threads = check_int("threads", threads, 1)
        if not isinstance(engine, str):
            raise TypeError(f"engine must be a str, got {type(engine).__name__}")
        if direct is not None:
            direct = check_bool("direct", direct, "None, True or False")
        submit_batch = check_int("submit_batch", submit_batch, 0)
        self._native = _C.Handle(block_size, queue_depth, threads, engine, direct, submit_batch)
        self.block_size, self.queue_depth, self.threads, self.direct = block_size, queue_depth, threads, direct
        self.submit_batch = submit_batch
        self._lock = threading.Lock()
        self._pending: Dict[Future, None] = {}    # futures not yet accounted for by wait() (a dict as an ordered set)
        self._settled = 0     # bytes of finished futures let go of since the last wait()
        self._prune_at = _PRUNE_MIN  # prune finished futures when this many are tracked (doubling: O(1) amortised)

    @classmethod
    def from_config(cls, config: Union[StrPath, Dict[str, Any]]) -> AioHandle:
        """A handle from a dict or a JSON file as written by `swapio tune` (unknown keys are an error)."""
        return cls(**config_settings(config))

    @property
    def engine(self) -> str:
        """The engine in use (what "auto" resolved to)."""
        return str(self._native.engine)

    def config(self) -> Dict[str, Any]:
        """The settings, as from_config() takes them (the engine as resolved)."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth, "threads": self.threads,
                "engine": self.engine, "direct": self.direct, "submit_batch": self.submit_batch}

    def pwrite(self, tensor: torch.Tensor, path: StrPath, offset: int = 0, *,
               identity: Optional[Tuple[int, ...]] = None, staged: Union[bool, str] = False) -> Future:
        """Writes tensor's bytes to path at offset (creating the file); returns a Future of bytes written.
        identity, staged: as for pread."""
        return self._submit("write", tensor, path, offset, identity=identity, staged=staged)

    def pread(self, tensor: torch.Tensor, path: StrPath, offset: int = 0, *,
              identity: Optional[Tuple[int, ...]] = None, staged: Union[bool, str] = False,
              restores: bool = False) -> Future:
        """Fills tensor with tensor.nbytes bytes of path at offset; returns a Future of bytes read.
        Autograd is told of the write when it is submitted, as by an in-place torch operation (the tensor's
        version counter moves: a backward through a graph that saved its old values raises). restores=True:
        the bytes are the ones the tensor held when autograd last saw it (a tensor swapped out and read back), so
        its version counter stays.
        identity=(st_dev, st_ino[, birth_ns]): the file must still be that one (say, one the caller created; birth_ns,
        its statx birth time, tells it from a file made later with its inode number): it is opened
        without following a symlink (nor created, for pwrite) and checked on each descriptor the I/O uses,
        else OSError here (ELOOP: a symlink, ESTALE: another file, ENOENT: none).
        staged=True: the O_DIRECT I/O goes through the workers' huge-page bounce buffers (copied on the workers,
        pipelined with the device) even when the memory is aligned, as misaligned memory always does. For
        ordinary (small-page) memory on disks where DMA into many small pages is slow: on ext4 over
        virtio-blk (Firecracker) reads into it ran at 0.63-0.81x of reads into huge pages, staged at 0.92-1.0x;
        writes 0.77x, staged 0.95x. staged="auto": staged unless the memory is swapio pinned memory (huge pages
        already; what swapio's own checkpoints, swaps and offload use)."""
        restores = check_bool("restores", restores)
        return self._submit("read", tensor, path, offset, identity=identity, staged=staged, changes=not restores)

    def _submit(self, op: str, tensor: torch.Tensor, path: StrPath, offset: int, record_latency: bool = False,
                identity: Optional[Tuple[int, ...]] = None, staged: Union[bool, str] = False,
                changes: bool = False) -> Future:
        ptr, nbytes = cpu_memory(tensor)
        path = check_path("path", path)
        offset = check_int("offset", offset, 0)
        if identity is not None:
            if not (isinstance(identity, tuple) and len(identity) in (2, 3)
                    and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64 for x in identity)):
                raise TypeError(f"identity must be a (st_dev, st_ino[, birth_ns]) tuple of unsigned 64-bit ints, got "
                                f"{identity!r}")
            identity = identity + (0,) * (3 - len(identity))  # birth time 0: not checked
        if isinstance(staged, str):
            if staged != "auto":
                raise ValueError(f"staged must be True, False or 'auto', got {staged!r}")
            staged = not is_pinned(tensor)
        else:
            staged = check_bool("staged", staged, "True, False or 'auto'")
        existed = op != "write" or os.path.lexists(path)
        if changes:
            check_writable_in_place(tensor)
            # before the read starts: an interrupt after it must not leave autograd untold (a read that then fails
            # leaves the counter moved, so a graph that saved the tensor raises rather than runs on silently)
            mark_written(tensor)
        try:
            request = self._native.submit(op, ptr, nbytes, path, offset, record_latency, identity, staged)
        except BaseException:
            if not existed:
                _remove_if_empty(path)  # the open created it, then failed (O_DIRECT refused, ...)
            raise
        if request.fell_back:
            warn_once(("fallback", file_system_key(os.path.dirname(os.path.abspath(path)))),
                      f"{path}: the file system refuses O_DIRECT; swapio falls back to buffered I/O "
                      "(pass direct=False to silence this, direct=True to make it an error)")
        # the storage too: a tensor given other memory meanwhile (t.set_(...), t.data = ...) lets go of this one
        memory = (tensor, tensor.untyped_storage())
        return self._track(Future(request, keepalive=memory, on_observed=self._let_go))

    def _track(self, future: Future) -> Future:
        with self._lock:
            self._pending[future] = None
            if len(self._pending) >= self._prune_at:
                for f in list(self._pending):
                    if f.done():
                        ok, value = f._settle()  # drops the memory it held
                        if ok:  # failures stay until wait() or their own wait() reports them
                            self._settled += value
                            del self._pending[f]
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._pending))
        return future

    def _let_go(self, future: Future) -> None:
        """A future whose outcome its caller has seen: counted (if it succeeded) and forgotten."""
        with self._lock:
            if future in self._pending:
                ok, value = future._settle()  # (first: a Ctrl-C here leaves it tracked, for wait() to count)
                del self._pending[future]
                if ok:
                    self._settled += value

    def wait(self) -> int:
        """Waits for every outstanding request; returns the bytes they moved, raises the first error not
        already raised by its own future."""
        with self._lock:
            pending, self._pending = list(self._pending), {}
            total, self._settled = self._settled, 0
            self._prune_at = _PRUNE_MIN
        first_error: Optional[BaseException] = None
        for i, f in enumerate(pending):
            try:
                ok, value = f._settle()
            except BaseException:
                # Interrupted (Ctrl-C): the rest stay tracked, so their memory lives until the kernel is done.
                with self._lock:
                    self._pending.update(dict.fromkeys(pending[i:]))
                    self._settled += total
                raise
            if ok:
                total += value
            elif first_error is None and not f.observed:
                first_error = value
                f.observed = True
            f._on_observed = None
        if first_error is not None:
            raise first_error
        return total

    def close(self) -> None:
        """Finishes every queued request, then stops the workers. Idempotent."""
        native = getattr(self, "_native", None)
        if native is not None and not native.closed:
            native.close()
            interrupted: Optional[BaseException] = None
            with self._lock:
                for f in self._pending:
                    try:
                        f._settle()  # every request is finished now: drop the memory they hold
                    except BaseException as exc:  # noqa: BLE001 - Ctrl-C: raised once the others let go too
                        interrupted = interrupted or exc
            if interrupted is not None:
                raise interrupted

    @property
    def closed(self) -> bool:
        """True after close()."""
        return bool(self._native.closed)

    def __repr__(self) -> str:
        return (f"AioHandle(block_size={self.block_size}, queue_depth={self.queue_depth}, "
                f"threads={self.threads}, engine={self.engine!r}, direct={self.direct}, "
                f"submit_batch={self.submit_batch})")
