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


def in_backward_updates(directory):
    """in_backward=True with no thread for its updates: the backward raises at the first weights it hands over, and
    their gradients stay for step(), which steps them as torch steps the .grad a failed backward left. They stayed
    queued, unseen by step(), and the next backward's gradients of the same weights replaced them."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from helpers.offload_training import MLP, batches, build_opt, loss_of, make_model, offload
    ref, model = make_model(), offload(make_model(), "cpu", directory)
    ref_opt = build_opt("AdamW", ref.parameters(), directory, offload="cpu")
    opt = build_opt("AdamW", model.parameters(), directory, offload="cpu", in_backward=True)
    data = batches(MLP, 3)
    loss = loss_of(model, data[0])
    exc = _limited(0, loss.backward)
    assert isinstance(exc, RuntimeError) and "thread" in str(exc), repr(exc)
    # what has a gradient (p.grad) when the backward stopped: the output layer's first weights handed over
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(name.startswith("c.") for name in with_grad), with_grad
    loss_of(ref, data[0]).backward()
    for name, p in ref.named_parameters():
        if name not in with_grad:
            p.grad = None
    for batch in [None, *data[1:]]:
        if batch is not None:
            loss_of(ref, batch).backward()
            loss_of(model, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    swapio.offload.remove_offload(model)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), (name, (a - b).abs().max())
    opt.close()


def main(directory):
    handle_threads(directory)
    future_callbacks(directory)
    in_backward_updates(directory)
    for save in ("sync", "async"):
        os.mkdir(os.path.join(directory, save))
        checkpoints(os.path.join(directory, save), save)
    print("passed")


if __name__ == "__main__":
    main(sys.argv[1])
