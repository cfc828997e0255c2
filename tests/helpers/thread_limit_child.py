"""Run by tests/io/test_thread_limit.py in a fresh interpreter with helpers/refuse_threads.c preloaded: each public
path meets a thread limit (pthread_create failing with EAGAIN after n more threads, for each n until one passes),
must fail with a clear error and leave nothing behind, and works once the limit is lifted."""
import ctypes
import gc
import os
import sys
import time

import torch

import swapio

_shim = ctypes.CDLL(None)


def _limited(n, fn):
    """fn() with at most n more threads startable: its error, or None when it passed."""
    _shim.refuse_threads_after(n)
    try:
        fn()
        return None
    except (OSError, RuntimeError) as exc:
        return exc
    finally:
        _shim.refuse_threads_after(-1)


def _fds():
    gc.collect()
    return sorted(os.listdir("/proc/self/fd"))


def handle_threads(directory):
    """An I/O thread refused: OSError EAGAIN naming the thread, and the contexts (io_uring descriptors) of the
    workers made and not made are all closed."""
    before = _fds()
    for n in range(3):
        exc = _limited(n, lambda: swapio.AioHandle(threads=3))
        assert isinstance(exc, OSError) and exc.errno == 11 and "thread" in str(exc), repr(exc)
        assert _fds() == before, (n, before, _fds())
    x = torch.randn(4096)
    with swapio.AioHandle(threads=3) as handle:
        handle.pwrite(x, os.path.join(directory, "x")).wait()
        y = torch.empty_like(x)
        handle.pread(y, os.path.join(directory, "x")).wait()
    assert torch.equal(x, y)


def future_callbacks(directory):
    """No thread for the callback watcher: add_done_callback raises, and later callbacks still run."""
    path = os.path.join(directory, "cb")
    with swapio.AioHandle() as handle:
        x = torch.randn(4 << 20)
        handle.pwrite(x, path).wait()
        # refused: a read that finished before add_done_callback runs its callback inline (no watcher needed), so
        # the refusal is asserted on the first of a few reads that was still running then
        refused = None
        for _ in range(5):
            calls = []
            future = handle.pread(torch.empty_like(x), path)
            exc = _limited(0, lambda: future.add_done_callback(calls.append))
            future.wait()
            if exc is not None or calls != [future]:
                refused = (exc, calls)
                break
        assert refused is not None and isinstance(refused[0], RuntimeError) and refused[1] == [], refused
        calls = []
        future = handle.pread(torch.empty_like(x), path)  # the limit lifted: a watcher starts, the callback runs
        future.add_done_callback(calls.append)
        future.wait()
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls == [future], calls


def checkpoints(directory, save):
    """A save that raises leaves the file as it was and no temporary file; one that returns wrote the new state;
    each limit, lifted, lets the next save (and the exit's wait for async saves) go through."""
    path = os.path.join(directory, f"{save}.safetensors")
    old, new = {"a": torch.zeros(64)}, {"a": torch.ones(64)}

    def do(state):
        if save == "async":
            swapio.checkpoint.async_save(state, path).wait(30)
        else:
            swapio.checkpoint.save(state, path)
    for n in range(8):
        do(old)
        exc = _limited(n, lambda: do(new))
        on_disk = swapio.checkpoint.load(path)["a"]
        assert torch.equal(on_disk, old["a"] if exc is not None else new["a"]), (save, n, exc)
        assert os.listdir(directory) == [os.path.basename(path)], (save, n, os.listdir(directory))
        if exc is None:
            return
    raise AssertionError(f"{save}: no save passed with 7 threads")


def main(directory):
    handle_threads(directory)
    future_callbacks(directory)
    for save in ("sync", "async"):
        os.mkdir(os.path.join(directory, save))
        checkpoints(os.path.join(directory, save), save)
    print("passed")


if __name__ == "__main__":
    main(sys.argv[1])
