"""SwapStore and the optimizers' swap directories under faults: a failed swap_in can be retried, one live store
per directory, leftovers of dead processes reclaimed, SIGTERM cleans up, checksums catch a flipped bit, clear
errors for misuse."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import swapio
import swapio.optim as so
from swapio.core import _swapdir
from conftest import REPO, TIMEOUT


def sample(seed=0, n=40000):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _flip_bit(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x04]))


def test_failed_swap_in_leaves_the_tensor_released_and_a_retry_refills_it(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    t = sample()
    expected = t.clone()
    s = store.swap_out(t).wait(TIMEOUT)
    good = open(s.path, "rb").read()
    os.truncate(s.path, 1000)  # a short file: the read fails
    with pytest.raises(OSError):
        s.swap_in().wait(TIMEOUT)
    assert not s.is_resident and t.untyped_storage().nbytes() == 0  # no garbage handed out as data
    with open(s.path, "r+b") as f:  # the same file, repaired
        f.write(good)
    assert s.swap_in().wait(TIMEOUT) is t
    assert s.is_resident and torch.equal(t, expected)
    store.close()


def test_swap_in_after_close_is_a_clear_error(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    t = sample()
    s = store.swap_out(t).wait(TIMEOUT)
    store.close()
    with pytest.raises(ValueError, match="closed"):
        s.swap_in()
    assert not s.is_resident and t.untyped_storage().nbytes() == 0


def test_verify_catches_a_flipped_bit_and_the_tensor_stays_released(tmp_path):
    store = swapio.SwapStore(tmp_path / "s", verify=True)
    t = sample()
    expected = t.clone()
    s = store.swap_out(t).wait(TIMEOUT)
    _flip_bit(s.path, 12345)
    with pytest.raises(OSError, match="checksum") as info:
        s.swap_in().wait(TIMEOUT)
    assert info.value.errno == errno.EIO and info.value.filename == s.path
    assert not s.is_resident
    with pytest.raises(OSError, match="checksum"):  # into a new tensor too
        s.swap_in(out=torch.empty_like(expected)).wait(TIMEOUT)
    _flip_bit(s.path, 12345)
    assert torch.equal(s.swap_in().wait(TIMEOUT), expected)
    store.close()


def test_second_live_store_on_a_directory_is_refused(tmp_path):
    a = swapio.SwapStore(tmp_path / "s")
    sa = a.swap_out(sample(), name="x", release=False).wait(TIMEOUT)
    with pytest.raises(OSError, match="another live SwapStore") as info:
        swapio.SwapStore(tmp_path / "s")
    assert info.value.errno == errno.EBUSY
    assert os.path.exists(sa.path)  # the refused store touched nothing
    a.close()
    b = swapio.SwapStore(tmp_path / "s")  # free again once the first is closed
    b.close()


def test_bad_keyword_fails_before_the_directory_is_made(tmp_path):
    with pytest.raises(TypeError):
        swapio.SwapStore(tmp_path / "new", nonsense=1)
    assert not (tmp_path / "new").exists()


def test_swap_out_of_a_released_tensor_says_so(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    t = sample()
    store.swap_out(t, name="a").wait(TIMEOUT)
    for release in (True, False):
        with pytest.raises(ValueError, match="released"):
            store.swap_out(t, name="b", release=release)
    assert not os.path.exists(os.path.join(store.directory, "b.swap"))
    store.close()


def test_swap_in_to_meta_is_refused(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    s = store.swap_out(sample(), release=False).wait(TIMEOUT)
    with pytest.raises(ValueError, match="meta"):
        s.swap_in(device="meta")
    store.close()


def _plant_symlink(path, tmp_path):
    decoy = tmp_path / "decoy.bin"
    decoy.write_bytes(b"\0" * os.path.getsize(path))
    os.unlink(path)
    os.symlink(decoy, path)


def _move_a_copy_over(path, tmp_path):
    other = tmp_path / "other.bin"
    other.write_bytes(open(path, "rb").read())  # the same bytes, but not the file swapio wrote
    os.replace(other, path)


def _recreate_at_the_same_name(path, tmp_path):
    size = os.path.getsize(path)
    os.unlink(path)
    with open(path, "wb") as f:  # ext4 hands the freed inode number straight back to this file
        f.write(b"\0" * size)


@pytest.mark.parametrize("replace, err, message", [(_plant_symlink, errno.ELOOP, "symlink"),
                                                   (_move_a_copy_over, errno.ESTALE, "another file"),
                                                   (_recreate_at_the_same_name, errno.ESTALE, "another file")])
def test_swap_file_replaced_after_swap_out_is_refused(tmp_path, replace, err, message):
    store = swapio.SwapStore(tmp_path / "s")
    s = store.swap_out(sample()).wait(TIMEOUT)
    replace(s.path, tmp_path)
    with pytest.raises(OSError, match=message) as info:
        s.swap_in()
    assert info.value.errno == err and not s.is_resident
    store.close()


class _SwapsFileAtOpen:
    """Stands in for a handle's native part: plants a symlink to `decoy` at the swap file's path just before
    the native open of an `op` request, the instant after every check in Python has run (the race an identity
    check in Python alone cannot see). path=None: the path the request names."""

    def __init__(self, native, op, decoy, path=None):
        self._native, self._op, self._decoy, self._path = native, op, decoy, path

    def submit(self, op, buf, length, path, *args, **kwargs):
        if op == self._op:
            os.unlink(self._path or path)
            os.symlink(self._decoy, self._path or path)
        return self._native.submit(op, buf, length, path, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._native, name)


def test_the_file_is_checked_on_the_descriptor_that_reads_it(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    t = sample()
    s = store.swap_out(t).wait(TIMEOUT)
    decoy = tmp_path / "decoy.bin"
    decoy.write_bytes(b"\x01" * t.numel() * 4)
    store.handle._native = _SwapsFileAtOpen(store.handle._native, "read", decoy, s.path)
    try:
        with pytest.raises(OSError, match="symlink") as info:
            s.swap_in().wait(TIMEOUT)
        assert info.value.errno == errno.ELOOP and not s.is_resident
    finally:
        store.handle._native = store.handle._native._native
    store.close()


def test_swap_out_writes_only_the_file_it_created(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep")
    store.handle._native = _SwapsFileAtOpen(store.handle._native, "write", victim)
    try:
        with pytest.raises(OSError, match="symlink") as info:
            store.swap_out(sample(), name="x", release=False).wait(TIMEOUT)
        assert info.value.errno == errno.ELOOP
    finally:
        store.handle._native = store.handle._native._native
    assert victim.read_bytes() == b"keep"
    assert "x" not in store
    store.close()


def test_swap_in_while_its_swap_out_is_creating_the_file_reads_nothing(tmp_path, monkeypatch):
    """Another thread's swap_in of a name whose swap_out has registered it but not yet created its file: an
    OSError, never a read of whatever is at the path then (here a symlink planted in that instant)."""
    store = swapio.SwapStore(tmp_path / "s")
    decoy = tmp_path / "decoy.bin"
    decoy.write_bytes(b"\x01" * 40000 * 4)
    real_create, seen = _swapdir.create_private_file, []

    def create(path):
        os.symlink(decoy, path)
        try:
            store["x"].swap_in(device="cpu").wait(TIMEOUT)
            seen.append("read")
        except OSError as exc:
            seen.append(exc.errno)
        os.unlink(path)
        return real_create(path)

    monkeypatch.setattr(_swapdir, "create_private_file", create)
    s = store.swap_out(sample(), name="x", release=False).wait(TIMEOUT)
    assert seen == [errno.ENOENT]
    assert torch.equal(s.swap_in().wait(TIMEOUT), sample())
    store.close()


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_as_swap_out_creates_the_file_leaves_no_file_behind(tmp_path, monkeypatch):
    """A Ctrl-C landing as swap_out's file was created, before swap_out knew it (found by fuzzing), left that
    file behind: forgotten by the store, so close() kept it, and the directory the store made with it."""
    store = swapio.SwapStore(tmp_path / "s")
    real_create = _swapdir.create_private_file

    def create(path):
        identity = real_create(path)
        signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt as this returns
        return identity

    monkeypatch.setattr(_swapdir, "create_private_file", create)
    with pytest.raises(KeyboardInterrupt):
        store.swap_out(sample(), name="x", release=False)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "s")) == [".swapio-owner"] and "x" not in store
    s = store.swap_out(sample(), name="x", release=False).wait(TIMEOUT)  # the name is free again
    assert torch.equal(s.swap_in().wait(TIMEOUT), sample())
    store.close()
    assert not os.path.exists(tmp_path / "s")


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_as_swap_in_submits_its_read_keeps_the_memory_it_reads_into(tmp_path, monkeypatch):
    """A Ctrl-C landing just after swap_in submitted the read that refills a released tensor (found by fuzzing:
    heap corruption, a crash later) freed that tensor's memory again while the read was still writing into it.
    The read stays the tensor's refill: the memory is kept, and the next swap_in returns that read."""
    from swapio.swap import SwappedTensor

    store = swapio.SwapStore(tmp_path / "s")
    t = sample()
    s = store.swap_out(t.clone(), release=True).wait(TIMEOUT)
    source = s._source
    assert source.untyped_storage().nbytes() == 0
    real = SwappedTensor._read_into

    def read_into(self, *args, **kwargs):
        future = real(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # Python raises KeyboardInterrupt as this returns
        return future

    monkeypatch.setattr(SwappedTensor, "_read_into", read_into)
    with pytest.raises(KeyboardInterrupt):
        s.swap_in()
    monkeypatch.undo()
    assert source.untyped_storage().nbytes() == t.nbytes  # what the read writes into is still allocated
    got = s.swap_in().wait(TIMEOUT)
    assert got is source and torch.equal(got, t) and s.is_resident
    store.close()


def test_pread_identity_is_checked(tmp_path):
    path = str(tmp_path / "f.bin")
    data = torch.arange(4096, dtype=torch.int32)
    with swapio.AioHandle() as h:
        h.pwrite(data, path).wait(TIMEOUT)
        st = os.stat(path)
        out = torch.empty_like(data)
        h.pread(out, path, identity=(st.st_dev, st.st_ino)).wait(TIMEOUT)
        assert torch.equal(out, data)
        with pytest.raises(OSError) as info:
            h.pread(out, path, identity=(st.st_dev, st.st_ino + 1))
        assert info.value.errno == errno.ESTALE and path in str(info.value)
        link = str(tmp_path / "link.bin")
        os.symlink(path, link)
        with pytest.raises(OSError) as info:
            h.pread(out, link, identity=(st.st_dev, st.st_ino))
        assert info.value.errno == errno.ELOOP
        h.pread(out, link).wait(TIMEOUT)  # without identity a symlink is followed, as open() does
        with pytest.raises(OSError) as info:  # pwrite with an identity never creates the file
            h.pwrite(data, str(tmp_path / "missing.bin"), identity=(st.st_dev, st.st_ino))
        assert info.value.errno == errno.ENOENT and not (tmp_path / "missing.bin").exists()
        for bad in ((st.st_dev,), [st.st_dev, st.st_ino], (st.st_dev, -1), (st.st_dev, 1 << 64), (True, 1), "x"):
            with pytest.raises(TypeError, match="identity"):
                h.pread(out, path, identity=bad)


def test_close_does_not_raise_again_a_write_error_already_raised(small_ext4_dir):
    store = swapio.SwapStore(small_ext4_dir / "s")
    s = store.swap_out(torch.zeros(64 << 20, dtype=torch.uint8))  # 64 MiB into 48 MiB
    with pytest.raises(OSError) as info:
        s.wait(TIMEOUT)
    assert info.value.errno == errno.ENOSPC
    store.close()  # the caller has seen the ENOSPC: not raised twice
    assert not (small_ext4_dir / "s").exists()


def test_ram_backed_directory_warns_and_a_refused_write_leaves_no_file(ramfs_dir, fresh_warnings):
    with pytest.warns(swapio.SwapioWarning, match="ramfs"):
        store = swapio.SwapStore(ramfs_dir / "s", direct=True)
    with pytest.raises(OSError):
        store.swap_out(sample(), name="x", release=False)
    assert sorted(os.listdir(store.directory)) == [_swapdir.LOCK_NAME]  # no empty x.swap
    store.close()


def test_optimizer_with_direct_on_ramfs_fails_at_construction(ramfs_dir, fresh_warnings):
    p = torch.zeros(10, requires_grad=True)
    with pytest.warns(swapio.SwapioWarning, match="RAM"):
        with pytest.raises(OSError, match="O_DIRECT") as info:
            so.OffloadAdamW([p], offload="nvme", swap_dir=ramfs_dir, direct=True)
    assert info.value.errno == errno.EINVAL
    assert os.listdir(ramfs_dir) == []


def _child(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prologue = textwrap.dedent(f"""
        import os, signal, sys, time, torch, swapio, swapio.optim as so
        d = {str(tmp_path)!r}
        store = swapio.SwapStore(os.path.join(d, "store"))
        store.swap_out(torch.ones(1 << 20), name="t").wait()
        p = torch.zeros(1 << 16, requires_grad=True)
        opt = so.OffloadAdamW([p], offload="nvme", swap_dir=d)
        p.grad = torch.ones_like(p)
        opt.step()
        print("ready", flush=True)
    """)
    return subprocess.Popen([sys.executable, "-c", prologue + textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _leftovers(tmp_path):
    return sorted([n for n in os.listdir(tmp_path) if n.startswith(_swapdir.PRIVATE_PREFIX)] +
                  [n for n in os.listdir(tmp_path / "store") if n.endswith(".swap")])


@pytest.mark.crash
def test_directories_of_a_killed_process_are_reclaimed_with_a_warning(tmp_path, fresh_warnings):
    proc = _child("os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGKILL and out == "ready\n", err
    assert len(_leftovers(tmp_path)) == 2  # its optimizer's directory and its store's file
    with pytest.warns(swapio.SwapioWarning, match="died") as record:
        store = swapio.SwapStore(tmp_path / "store")
        p = torch.zeros(4, requires_grad=True)
        opt = so.OffloadAdamW([p], offload="nvme", swap_dir=tmp_path)
    assert len(record) == 2 and _leftovers(tmp_path) == [os.path.basename(opt.swap_path)]
    opt.close()
    store.close()
    assert _leftovers(tmp_path) == []


@pytest.mark.crash
def test_sigterm_removes_swap_files_and_still_ends_the_process(tmp_path):
    proc = _child("time.sleep(60)", tmp_path)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGTERM, err
    assert not (tmp_path / "store").exists() and os.listdir(tmp_path) == []


def test_an_application_sigterm_handler_is_left_in_place(tmp_path, monkeypatch):
    def mine(signum, frame):
        pass

    monkeypatch.setattr(_swapdir, "_sigterm_installed", False)
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        swapio.SwapStore(tmp_path / "s").close()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_forked_child_closing_its_copies_leaves_the_parents_files(tmp_path):
    store = swapio.SwapStore(tmp_path / "s")
    s = store.swap_out(sample(), release=False).wait(TIMEOUT)
    p = torch.zeros(1024, requires_grad=True)
    opt = so.OffloadAdamW([p], offload="nvme", swap_dir=tmp_path)
    pid = os.fork()
    if pid == 0:  # the child: run the clean-ups its exit or garbage collection would run, leave at once
        try:
            store.close()
            opt._backend._finalizer()  # what opt.close() and collection run (handles' teardown after fork:
        finally:                       # the native core's part)
            os._exit(0)
    deadline = time.monotonic() + TIMEOUT
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child hung")
        time.sleep(0.01)
    assert os.path.exists(s.path) and os.path.isdir(opt.swap_path)
    p.grad = torch.ones_like(p)
    opt.step()  # the parent's optimizer still works
    opt.close()
    store.close()
    assert os.listdir(tmp_path) == []


def test_identity_tells_a_file_recreated_with_the_same_inode_number_apart(tmp_path):
    path = str(tmp_path / "f.bin")
    data = torch.arange(4096, dtype=torch.int32)
    with swapio.AioHandle() as h:
        identity = _swapdir.create_private_file(path)
        h.pwrite(data, path, identity=identity).wait(TIMEOUT)
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(bytes(data.numel() * 4))
        out = torch.full_like(data, -1)
        for op, tensor in (("pread", out), ("pwrite", data)):
            with pytest.raises(OSError) as info:
                getattr(h, op)(tensor, path, identity=identity)
            assert info.value.errno == errno.ESTALE, op
        with pytest.raises(OSError) as info:
            _swapdir.resize_private_file(path, identity, 0)
        assert info.value.errno == errno.ESTALE
        assert torch.equal(out, torch.full_like(data, -1)) and open(path, "rb").read() == bytes(data.numel() * 4)
        # the file itself still passes, by the same identity
        identity = _swapdir.create_private_file(path)
        h.pwrite(data, path, identity=identity).wait(TIMEOUT)
        assert h.pread(out, path, identity=identity).wait(TIMEOUT) == data.numel() * 4 and torch.equal(out, data)
