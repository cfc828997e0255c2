"""Shared helpers for the swapio I/O-core tests.

Every wait carries a timeout so a hang fails the test instead of blocking CI.
"""
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout without `pip install`
    sys.path.insert(0, REPO)

import swapio  # noqa: E402


def pytest_configure(config):
    """Ctrl-C raises KeyboardInterrupt in every test, as in a foreground run, even where the runner started with SIGINT
    ignored (a background job of a non-interactive shell, nohup): the tests that send themselves a real SIGINT
    expect Python's own handler (with SIGINT ignored, 5 of them failed)."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    """Moves what the test modules' imports made (torch, transformers, ...: most of the objects the session ever
    holds) out of the cyclic collector's sight: the tests' own gc.collect() calls (hundreds, to see what a test's
    cycles held released) then each cost milliseconds instead of a quarter of a second."""
    gc.collect()
    gc.freeze()


TIMEOUT = 60  # seconds any single wait may take before the test fails
MiB = 1 << 20
ENGINES = ("uring", "aio", "psync")


def engine_param(name):
    """pytest.param for an engine, skipped with the reason when this kernel cannot set it up."""
    status = swapio.info()["engines"].get(name, "unknown engine")
    marks = [] if status == "ok" else [pytest.mark.skip(reason=f"engine {name} unavailable here: {status}")]
    return pytest.param(name, id=name, marks=marks)


ENGINE_PARAMS = [engine_param(e) for e in ENGINES]


def random_bytes(nbytes, seed=0):
    """A uint8 tensor of reproducible random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def as_bytes(tensor):
    """The bytes of a tensor's elements in memory order (any dtype, any layout)."""
    t = tensor.contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    # Through a copy: .numpy() on the tensor itself would pin its storage (torch then refuses to resize it).
    return t.view(torch.uint8).clone().numpy().tobytes()


def read_file(path):
    """The file's whole contents, read with plain Python (no swapio)."""
    with open(path, "rb") as f:
        return f.read()


def unaligned_uint8(nbytes, seed=0):
    """A uint8 tensor of nbytes whose data pointer is one byte past an allocation start (misaligned)."""
    base = torch.empty(nbytes + 1, dtype=torch.uint8)
    t = base[1:]
    t.copy_(random_bytes(nbytes, seed))
    assert t.data_ptr() % 2 == 1 or nbytes == 0
    return t


def run_python(code, *argv, timeout=TIMEOUT):
    """`python -c code *argv` in a fresh interpreter that imports this checkout's swapio (a scenario whose failure
    may crash the process: the test then sees a return code, not its own death)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def wait_handle(handle, timeout=TIMEOUT):
    """handle.wait() has no timeout parameter: run it on a helper thread and fail if it hangs."""
    box = {}

    def run():
        try:
            box["value"] = handle.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"AioHandle.wait() did not return within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def close_handle(handle, timeout=TIMEOUT):
    """handle.close() with a hang guard (it finishes outstanding requests first)."""
    t = threading.Thread(target=handle.close, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"AioHandle.close() did not return within {timeout} s")


def queued_behind_big_read(handle_factory, tmp_path, nbytes=10):
    """(big, queued, out): a small read certainly still pending right after submission, because a single-slot
    psync worker runs requests in order and it sits behind 64 MiB of 4 KiB reads. Wait on `big` when done."""
    h = handle_factory(engine="psync", block_size=4096, queue_depth=1, threads=1, direct=False)
    big_path, small_path = tmp_path / "queued-big.bin", tmp_path / "queued-small.bin"
    with open(big_path, "wb") as f:
        f.truncate(64 * MiB)
    small_path.write_bytes(b"s" * nbytes)
    big = h.pread(torch.empty(64 * MiB, dtype=torch.uint8), big_path)
    out = torch.empty(nbytes, dtype=torch.uint8)
    return big, h.pread(out, small_path), out


def live_threads():
    """Threads of this process that have not begun to exit. A joined thread stays listed in /proc/self/task a
    moment after pthread_join() returns, but the kernel marks it exiting (PF_EXITING in the flags field of its
    stat) before that, so it is never counted here (tests/native/helpers.h counts the same way)."""
    exiting = 0x4  # PF_EXITING, include/linux/sched.h
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()  # after "pid (comm) ": state ppid ... flags
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # gone meanwhile
        if not int(fields[6]) & exiting:
            count += 1
    return count


def open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this test whatever handler an earlier test left in place (pytest_configure
    sets Python's own for the session), and the handler before it is put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def handle_factory():
    """Makes AioHandles and closes every one of them at teardown."""
    made = []

    def make(**kwargs):
        h = swapio.AioHandle(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        close_handle(h)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state (mixed precision, gradient accumulation) in process-wide singletons, which the next
    Accelerator() takes as they are: a test's Accelerator(mixed_precision="bf16") made a later test's Accelerator()
    autocast its forwards too (logits no longer the resident model's), and refused another mixed precision. Reset
    around every test, where accelerate was imported."""
    def reset():
        state = sys.modules.get("accelerate.state")
        if state is not None:
            state.AcceleratorState._reset_state(reset_partial_state=True)
            state.GradientState._reset_state()
    reset()
    yield
    reset()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """swapio warns once per file system (O_DIRECT fallback, RAM-backed) per process; start this test with no
    warning given yet."""
    monkeypatch.setattr(swapio.core._errors, "_warned", set())


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)


def _unmount(directory):
    if _run(["umount", str(directory)]).returncode != 0:
        _run(["umount", "-l", str(directory)])


@contextlib.contextmanager
def mounted(directory, mount_cmd, what):
    """Runs mount_cmd (mounting onto directory); skips the test with the reason if the machine refuses."""
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip(f"cannot mount {what}: no mount command")
    r = _run(mount_cmd)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {what} here: {(r.stderr or r.stdout).strip()}")
    try:
        yield directory
    finally:
        _unmount(directory)


@pytest.fixture
def ramfs_dir(tmp_path):
    """A fresh ramfs mount (a file system that refuses O_DIRECT)."""
    d = tmp_path / "ramfs"
    with mounted(d, ["mount", "-t", "ramfs", "ramfs", str(d)], "ramfs"):
        yield d


@pytest.fixture
def small_ext4_dir(tmp_path):
    """A 48 MiB ext4 file system on a loop device (supports O_DIRECT; small enough to fill)."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    img = tmp_path / "small.img"
    with open(img, "wb") as f:
        f.truncate(48 * MiB)
    r = _run(["mkfs.ext4", "-q", "-F", str(img)])
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    d = tmp_path / "small"
    with mounted(d, ["mount", "-o", "loop", str(img), str(d)], "a loop ext4 image"):
        yield d


@pytest.fixture
def readonly_dir(tmp_path):
    """A read-only bind mount of a directory holding one file, `ro/existing.bin` (4096 bytes)."""
    src = tmp_path / "rw"
    src.mkdir()
    (src / "existing.bin").write_bytes(bytes(range(256)) * 16)
    d = tmp_path / "ro"
    with mounted(d, ["mount", "--bind", str(src), str(d)], "a bind mount"):
        r = _run(["mount", "-o", "remount,ro,bind", str(d)])
        if r.returncode != 0:
            pytest.skip(f"cannot remount the bind mount read-only: {r.stderr.strip()}")
        yield d


@pytest.fixture
def bars(monkeypatch):
    """Every bar swapio draws (tqdm objects), and no SWAPIO_PROGRESS from the environment running the tests."""
    from swapio import _progress
    monkeypatch.delenv(_progress.ENV, raising=False)
    drawn, real = [], _progress.bar

    def recording(*args, **kwargs):
        b = real(*args, **kwargs)
        if b is not None:
            drawn.append(b)
        return b

    monkeypatch.setattr(_progress, "bar", recording)
    return drawn
