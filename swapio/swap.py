"""SwapStore / SwappedTensor: async swap-out of tensors to files and swap-in back, any dtype, size or device."""
import os
import re
import threading

import torch

from ._closeable import Closeable
from ._errors import check_path
from .futures import Future
from .handle import AioHandle
from .pinned import empty_pinned
from .tensors import spans_whole_storage

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
SUFFIX = ".swap"


def _private_file(path):
    """Creates (or truncates) a 0600 regular file, refusing to follow a symlink planted at its name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class SwappedTensor:
    """A tensor whose bytes are (being) written to a file; ``swap_in()`` brings them back."""

    def __init__(self, store, name, path, tensor, release):
        self.store, self.name, self.path = store, name, path
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self._source = tensor if release else None  # the caller's object: freed, then refilled by swap_in
        self._release_pending = release  # free the source's storage once the write is waited on
        self._released = False
        self._write = None
        self._lock = threading.Lock()

    @property
    def is_resident(self):
        """True while the tensor's memory still holds the data (not released after the swap-out)."""
        return not self._released

    def wait(self, timeout=None):
        """Waits for the swap-out; raises its OSError. With release=True, frees the tensor's storage now."""
        with self._lock:
            write = self._write
        if write is not None:
            write.wait(timeout)
            with self._lock:
                if self._release_pending:
                    self._release_pending = False
                    self._source.untyped_storage().resize_(0)
                    self._released = True
        return self

    def swap_in(self, device=None, out=None):
        """Reads the bytes back; the Future's value is the tensor on `device` (default: where it came from).

        With out=None and a released source tensor on that device, the source tensor itself is refilled
        (its storage regrown), so references to it are valid again. Waits for a pending swap-out first.
        """
        self.wait()
        device = torch.device(device) if device is not None else self.device
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            if out.shape != self.shape or out.dtype != self.dtype:
                raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; expected {tuple(self.shape)} {self.dtype}")
            target = out
        elif self._released and device == self.device:
            target = self._source
            target.untyped_storage().resize_(self.nbytes)
        else:
            target = torch.empty(self.shape, dtype=self.dtype, device=device)
        if target is self._source:
            with self._lock:
                self._released = False
        if target.device.type == "cpu" and target.is_contiguous():
            return self.store.handle.pread(target.detach().view(-1), self.path, 0)._chain(lambda n: target)
        # GPU or strided targets: read into pinned memory, then copy (asynchronously for a GPU).
        staging = empty_pinned(self.shape, self.dtype)
        read = self.store.handle.pread(staging.view(-1), self.path, 0)

        def copy_out(_):
            with torch.no_grad():
                target.copy_(staging, non_blocking=target.device.type == "cuda")
            if target.device.type == "cuda":
                torch.cuda.current_stream(target.device).synchronize()
            return target
        return read._chain(copy_out)

    def __repr__(self):
        where = "resident" if self.is_resident else "on disk"
        return f"<SwappedTensor {self.name!r} {tuple(self.shape)} {self.dtype} {where}>"


class SwapStore(Closeable):
    """Swap files for tensors under one directory, written and read through one AioHandle.

    Files are named ``<name>.swap`` (stable across runs), created 0600 without following symlinks, and hold
    exactly the tensor's bytes. ``close()`` removes them (and the directory, if the store created it).
    """

    def __init__(self, directory, handle=None, **handle_kwargs):
        directory = os.path.abspath(check_path("directory", directory))
        if handle is not None and handle_kwargs:
            raise ValueError("pass either handle or AioHandle keyword arguments, not both")
        if handle is not None and not isinstance(handle, AioHandle):
            raise TypeError(f"handle must be a swapio.AioHandle, got {type(handle).__name__}")
        self._created_dir = not os.path.isdir(directory)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = directory
        self.handle = handle if handle is not None else AioHandle(**handle_kwargs)
        self._owns_handle = handle is None
        self._tensors = {}
        self._counter = 0
        self._lock = threading.Lock()
        self._closed = False

    def swap_out(self, tensor, name=None, release=True):
        """Starts writing `tensor` to ``<directory>/<name>.swap``; returns a SwappedTensor (``.wait()``).

        release=True frees the tensor's storage once the write is waited on; it needs a tensor that spans
        its whole storage (not a view of a larger one).
        """
        if self._closed:
            raise ValueError("the SwapStore is closed")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError("only dense (strided) tensors can be swapped")
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
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"bad swap name {name!r}: use letters, digits, '_', '.', '-' (not starting "
                                 "with '.' or '-', at most 200 characters)")
            if name in self._tensors:
                raise ValueError(f"a tensor named {name!r} is already in this store; remove() it first")
            path = os.path.join(self.directory, name + SUFFIX)
            swapped = SwappedTensor(self, name, path, tensor, release)
            self._tensors[name] = swapped
        try:
            _private_file(path)
            source = tensor.detach()
            if source.device.type != "cpu" or not source.is_contiguous():
                staging = empty_pinned(source.shape, source.dtype)
                staging.copy_(source)  # synchronous for a GPU tensor: the bytes are on the host after this
                source = staging
            swapped._write = self.handle.pwrite(source.view(-1), path, 0)
        except BaseException:
            with self._lock:
                self._tensors.pop(name, None)
            raise
        return swapped

    def remove(self, swapped):
        """Forgets a swapped tensor and deletes its file (after any pending write)."""
        with self._lock:
            if self._tensors.get(swapped.name) is not swapped:
                raise ValueError(f"{swapped!r} does not belong to this store")
            del self._tensors[swapped.name]
        try:
            swapped.wait()
        finally:
            try:
                os.unlink(swapped.path)
            except FileNotFoundError:
                pass

    def __contains__(self, name):
        return name in self._tensors

    def __len__(self):
        return len(self._tensors)

    def __getitem__(self, name):
        return self._tensors[name]

    def close(self):
        """Waits for pending writes, removes every swap file (and the directory if the store made it)."""
        if self._closed:
            return
        self._closed = True
        first_error = None
        for swapped in list(self._tensors.values()):
            try:
                self.remove(swapped)
            except Exception as exc:  # noqa: BLE001 - clean up the rest, then report the first
                first_error = first_error or exc
        if self._owns_handle:
            self.handle.close()
        if self._created_dir:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass  # not empty: someone else's files are there
        if first_error is not None:
            raise first_error

