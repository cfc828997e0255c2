"""SwapStore / SwappedTensor: async swap-out of tensors to files and swap-in back, any dtype, size or device."""
from __future__ import annotations

import errno
import os
import re
import threading
from typing import Any, Dict, Optional, Union

import torch

from .core import _checksum, _durable, _swapdir, cuda_copy
from .core._closeable import Closeable
from .core._signals import DeferredSigint
from .core._errors import NotCopyable, StrPath, check_bool, check_path
from .core.futures import Future
from .core.handle import AioHandle, check_moves_data
from .core.cuda_copy import usable_device
from .core.pinned import empty_pinned
from .core.tensors import check_dense, check_writable_in_place, mark_written, restoring, spans_whole_storage

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")  # fullmatch: "$" let a trailing newline through
SUFFIX = ".swap"


class SwappedTensor(NotCopyable):
    """A tensor whose bytes are (being) written to a file; ``swap_in()`` brings them back."""

    def __init__(self, store, name, path, tensor, release):
        self.store, self.name, self.path = store, name, path
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        # its layout (a meta tensor: no memory), so a new tensor swap_in makes keeps a channels_last or transposed
        # source's strides, as torch's .to()/.clone() do
        self._like = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        self._source = tensor if release else None  # the caller's object: freed, then refilled by swap_in
        self._release_pending = release  # free the source's storage once the write is waited on
        self._released = False
        self._write = None
        self._file = None    # (device, inode) of the swap file
        self._digest = None  # checksum of the bytes written (verify=True)
        self._refill = None  # the swap_in refilling the released source, while it runs
        self._reads_from = None  # the storage (its _cdata) the write reads, when that is the caller's own memory
        self._lock = threading.Lock()

    @property
    def is_resident(self) -> bool:
        """True while the tensor's memory still holds the data (not released after the swap-out)."""
        return not self._released

    def wait(self, timeout: Optional[float] = None) -> SwappedTensor:
        """Waits for the swap-out; raises its OSError. With release=True, frees the tensor's storage now."""
        with self._lock:
            write = self._write
        if write is not None:
            write.wait(timeout)
            if self._release_pending:
                # another swap_out of this store may still be reading the same memory (the tensor swapped out
                # twice): freeing it under that write crashed the worker or wrote garbage to its file
                self.store._settle_writes_from(self, timeout)
            with self._lock:
                if self._release_pending:
                    self._release_pending = False
                    self._source.untyped_storage().resize_(0)
                    self._released = True
        return self

    def swap_in(self, device: Union[None, str, int, torch.device] = None,
                out: Optional[torch.Tensor] = None) -> Future:
        """Reads the bytes back; the Future's value is the tensor on `device` (default: where it came from).

        With out=None and a released source tensor on that device, the source tensor itself is refilled
        (its storage regrown), so references to it are valid again; a new tensor has the strides the source's
        ``.clone()`` would have. Waits for a pending swap-out first.
        If the read fails (or, with verify=True, the bytes do not match their checksum), the source stays
        released (not resident), the swap file stays as it is, and swap_in can be called again.
        """
        self.store._check_open()
        if self.store._tensors.get(self.name) is not self:  # its file is gone, or is another tensor's by now
            raise ValueError(f"{self!r} was removed from its SwapStore (its swap file was deleted)")
        self.wait()
        dev: torch.device = usable_device(device, "swap_in") if device is not None else self.device
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if out.shape != self.shape or out.dtype != self.dtype:
                raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; expected {tuple(self.shape)} {self.dtype}")
            check_writable_in_place(out, "out")  # torch's rules for a copy_ into it
            dev = out.device
        if dev.type == "meta":
            raise ValueError("swap_in(device='meta'): a meta tensor has no memory to read the bytes into")
        # A Ctrl-C waits until the read is submitted and recorded: landing just after the submission, it freed the
        # refilled memory again under the read still writing into it
        with self._lock, DeferredSigint():
            refill = out is None and self._released and dev == self.device
            if refill and self._refill is not None:
                return self._refill  # already being refilled: one read into the source, not two
            if refill:
                target = self._source
                with cuda_copy.allocating_on_side_stream(dev):  # the copy writes it there, nothing waits
                    target.untyped_storage().resize_(self.nbytes)
            elif out is not None:
                target = out
            else:
                with cuda_copy.allocating_on_side_stream(dev):
                    target = torch.empty_like(self._like, device=dev)
            try:
                future = self._read_into(target, refill, caller_owned=out is not None)
            except BaseException:
                if refill:
                    target.untyped_storage().resize_(0)
                raise
            if out is not None:
                # a change in place, told to autograd now, as a copy_ into it would; a refill puts back the bytes
                # autograd saw before the swap-out, so a graph that saved the source still runs
                mark_written(out)
            if refill:
                self._refill = future
        return future

    def _read_into(self, target, refill, caller_owned):
        if self._file is None:  # another thread's swap_out of it has not created the file yet
            raise OSError(errno.ENOENT, "the swap file is not written yet: its swap_out has not returned", self.path)
        verify = self._digest is not None
        cuda = target.device.type == "cuda"

        def done(_):
            if verify and _checksum.digest(staging if staging is not None else target) != self._digest:
                raise OSError(errno.EIO, "checksum mismatch: the swap file's bytes are not the ones swapped out "
                              "(the file was modified or the disk returned corrupted data)", self.path)
            if staging is not None and not cuda:
                with torch.no_grad(), restoring(target):
                    target.copy_(staging)
            if refill:
                with self._lock:
                    self._released, self._refill = False, None
            return target

        def failed(_):
            if refill:
                with self._lock:
                    self._source.untyped_storage().resize_(0)  # no garbage left in the caller's tensor
                    self._refill = None

        staging = None
        # The writes into target leave its version counter: swap_in tells autograd of a read into `out` itself
        if target.device.type == "cpu" and target.is_contiguous():
            read = self.store.handle.pread(target.detach().view(-1), self.path, 0, identity=self._file,
                                           staged="auto", restores=True)
        else:  # GPU or strided targets: read into pinned memory, then copy
            staging = empty_pinned(self.shape, self.dtype)
            read = self.store.handle.pread(staging.view(-1), self.path, 0, identity=self._file)
        checked = read._chain(done, failed)
        if not cuda:
            return checked
        # Work queued on the caller's stream before this call may still use `out`: the copy waits for that (an
        # event recorded now), never for work queued later, and nothing synchronises a whole stream.
        before = torch.cuda.current_stream(target.device).record_event() if caller_owned else None
        stream = cuda_copy.copy_stream(target.device)

        def issue():
            with restoring(target):
                return cuda_copy.copy_async(target, staging, stream, wait_for=before)
        return cuda_copy.DeviceCopyFuture(checked, issue, target)

    def __repr__(self):
        where = "resident" if self.is_resident else "on disk"
        return f"<SwappedTensor {self.name!r} {tuple(self.shape)} {self.dtype} {where}>"


class SwapStore(NotCopyable, Closeable):
    """Swap files for tensors under one directory, written and read through one AioHandle.

    Files are named ``<name>.swap`` (stable across runs), created 0600 without following symlinks, and hold
    exactly the tensor's bytes. ``close()`` removes them (and the directory, if the store created it).
    One live store per directory: a second one raises OSError(EBUSY) (a flock on ``.swapio-owner``), and swap
    files left by a store whose process died are removed by the next store on the directory, with a warning.
    verify=True keeps an xxh3 checksum of each tensor swapped out; swap_in raises OSError(EIO) if the bytes read
    back differ.
    """

    def __init__(self, directory: StrPath, handle: Optional[AioHandle] = None, verify: bool = False,
                 **handle_kwargs: Any) -> None:
        directory = os.path.abspath(check_path("directory", directory))
        if handle is not None and handle_kwargs:
            raise ValueError("pass either handle or AioHandle keyword arguments, not both")
        if handle is not None and not isinstance(handle, AioHandle):
            raise TypeError(f"handle must be a swapio.AioHandle, got {type(handle).__name__}")
        verify = check_bool("verify", verify)
        self._closed = True  # until set up (close(), from the finalizer too, lets go of self._owner once it is set)
        own_handle = AioHandle(**handle_kwargs) if handle is None else None  # bad settings fail before mkdir
        chosen = handle if handle is not None else own_handle
        assert chosen is not None
        try:
            check_moves_data(chosen, "SwapStore")  # (engine="null": swap_in gave garbage)
        except BaseException:
            if own_handle is not None:
                own_handle.close()
            raise
        self.directory = directory
        self.handle: AioHandle = chosen
        self._owns_handle = handle is None
        self.verify = verify
        self._tensors: Dict[str, SwappedTensor] = {}
        self._counter = 0
        self._lock = threading.Lock()
        created = not os.path.isdir(directory)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            _swapdir.warn_if_ram_backed(directory, "SwapStore directory")
            with DeferredSigint():  # the claim is this store's before a Ctrl-C lands: its close() lets go of it
                self._owner: _swapdir.Owner = _swapdir.claim(directory, created)
        except BaseException:
            if "_owner" in self.__dict__:  # (a Ctrl-C deferred past the claim)
                self._owner.release()
            if own_handle is not None:
                own_handle.close()
            if created:  # with the lock file a claim cut short left (ours alone: made in our new directory)
                _durable.discard(os.path.join(directory, _swapdir.LOCK_NAME), directory)
            raise
        self._closed = False

    def _check_open(self):
        if self._closed:
            raise ValueError("the SwapStore is closed (its swap files were removed)")

    def swap_out(self, tensor: torch.Tensor, name: Optional[str] = None, release: bool = True) -> SwappedTensor:
        """Starts writing `tensor` to ``<directory>/<name>.swap``; returns a SwappedTensor (``.wait()``).

        release=True frees the tensor's storage once the write is waited on; it needs a tensor that spans
        its whole storage (not a view of a larger one).
        """
        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        release = check_bool("release", release)  # (release="False" freed the tensor's memory)
        check_dense(tensor)
        if tensor.device.type == "meta":
            raise ValueError("tensor is on the meta device: it has no bytes to swap out")
        if tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0:
            raise ValueError("tensor has no memory: it was released by an earlier swap_out(release=True) (or its "
                             "storage was resized to 0); swap_in() it first")
        if release and not spans_whole_storage(tensor):
            raise ValueError("release=True frees the tensor's whole storage, but this tensor is a view of a "
                             "larger one; pass release=False")
        if release and not tensor.untyped_storage().resizable():
            raise ValueError("release=True needs a resizable storage, but this tensor's memory is borrowed "
                             "(e.g. from numpy); pass release=False")
        with self._lock:
            if name is None:
                while f"tensor{self._counter}" in self._tensors:
                    self._counter += 1
                name = f"tensor{self._counter}"
            if not isinstance(name, str):
                raise TypeError(f"a swap name must be a str, got {type(name).__name__} {name!r}")
            if not _NAME.fullmatch(name):
                raise ValueError(f"bad swap name {name!r}: use letters, digits, '_', '.', '-' (not starting "
                                 "with '.' or '-', at most 200 characters)")
            if name in self._tensors:
                raise ValueError(f"a tensor named {name!r} is already in this store; remove() it first")
            path = os.path.join(self.directory, name + SUFFIX)
            swapped = SwappedTensor(self, name, path, tensor, release)
            self._tensors[name] = swapped
        creating = False
        try:
            self._owner.files.add(path)
            creating = True  # from here the file may exist before _file says so (a Ctrl-C as it is created)
            swapped._file = _swapdir.create_private_file(path)
            source = tensor.detach()
            if source.device.type != "cpu" or not source.is_contiguous():
                staging = empty_pinned(source.shape, source.dtype)
                staging.copy_(source)  # synchronous for a GPU tensor: the bytes are on the host after this
                source = staging
            else:
                swapped._reads_from = source.untyped_storage()._cdata
            if self.verify:
                swapped._digest = _checksum.digest(source)
            swapped._write = self.handle.pwrite(source.view(-1), path, 0, identity=swapped._file, staged="auto")
        except BaseException:
            with self._lock:
                self._tensors.pop(name, None)
            if creating:  # never leave the empty file behind (the name is this store's: reserved above)
                _unlink(path)
            self._owner.files.discard(path)
            raise
        return swapped

    def _settle_writes_from(self, swapped: SwappedTensor, timeout: Optional[float]) -> None:
        """Waits (without reporting their errors: their own wait() does) for the other writes still reading the
        memory `swapped` is about to release."""
        if swapped._reads_from is None:
            return
        with self._lock:
            others = [o._write for o in self._tensors.values()
                      if o is not swapped and o._reads_from == swapped._reads_from and o._write is not None]
        for write in others:
            write._settle(timeout)

    def remove(self, swapped: SwappedTensor) -> None:
        """Forgets a swapped tensor and deletes its file (after any pending write). A write error is raised
        here only if nobody has seen it yet."""
        if not isinstance(swapped, SwappedTensor):
            hint = f" (by name: remove(store[{swapped!r}]))" if isinstance(swapped, str) else ""
            raise TypeError(f"remove() takes the SwappedTensor swap_out returned, got {type(swapped).__name__}{hint}")
        with self._lock:
            if self._tensors.get(swapped.name) is not swapped:
                self._check_open()  # close() removed every tensor: say so, not that this one is a stranger
                raise ValueError(f"{swapped!r} does not belong to this store")
            del self._tensors[swapped.name]
        seen = swapped._write is not None and swapped._write.observed
        try:
            swapped.wait()
        except Exception:  # (a Ctrl-C is the caller's either way)
            if not seen:
                raise
        finally:
            _unlink(swapped.path)
            self._owner.files.discard(swapped.path)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, name: str) -> SwappedTensor:
        return self._tensors[name]

    def close(self) -> None:
        """Waits for pending writes, removes every swap file (and the directory if the store made it). Raises
        the first write error nobody has seen yet. A close() cut short (Ctrl-C while a write is waited for) is
        finished by the next one, or when the store is freed."""
        self._closed = True  # (first: no swap_out from here)
        owner = self.__dict__.get("_owner")  # (None: __init__ failed before the claim)
        if owner is None or owner.released:
            return
        if owner.pid != os.getpid():
            return  # a forked child's copy of the store: the files and the handle's workers are the parent's
        first_error = None
        for swapped in list(self._tensors.values()):
            try:
                self.remove(swapped)
            except Exception as exc:  # noqa: BLE001 - clean up the rest, then report the first
                first_error = first_error or exc
        with DeferredSigint():  # the handle, the lock and the directory let go of whole: a Ctrl-C after that
            if self._owns_handle:
                self.handle.close()
            owner.release()
            if owner.created:
                _durable.discard(self.directory)  # kept if someone else's files are there
        if first_error is not None:
            raise first_error


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
