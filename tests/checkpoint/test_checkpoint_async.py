"""async_save: it returns once the bytes are captured, so a tensor changed right after it is written with the
values it had at the call (torch DCP's bug #144657 must not happen here), whether the tensor was captured into
the pinned staging or into the unpinned snapshot; saves queue in order; wait() raises the save's error."""
import errno
import os
import threading

import pytest
import torch

import swapio
from helpers.checkpoint import assert_same, leftovers, training_state

MiB = 1 << 20


@pytest.mark.parametrize("staging", [1 * MiB, 64 * MiB], ids=["snapshot", "pinned"])
def test_tensors_changed_after_async_save_returns_are_saved_as_they_were(tmp_path, staging):
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(1_000_000, generator=g), "b": torch.randn(300, 7, generator=g).t(),  # 4 MB, strided
             "tail": torch.randn(700_000, generator=g)}
    expected = {k: v.clone() for k, v in model.items()}
    fut = swapio.checkpoint.async_save({"model": model, "step": 1}, tmp_path / "c.safetensors",
                                       staging_bytes=staging)
    for v in model.values():  # training goes on at once
        v.mul_(-3).add_(1)
    assert fut.wait(timeout=60) == (tmp_path / "c.safetensors").stat().st_size
    back = swapio.checkpoint.load(tmp_path / "c.safetensors")
    assert_same(back, {"model": expected, "step": 1})
    assert not torch.equal(back["model"]["w"], model["w"])  # the change was real


def test_async_save_returns_a_swapio_future(tmp_path):
    fut = swapio.checkpoint.async_save(training_state(), tmp_path / "c.safetensors")
    assert isinstance(fut, swapio.Future)
    fut.result(timeout=60)
    assert fut.done() and fut.exception() is None
    assert_same(swapio.checkpoint.load(tmp_path / "c.safetensors"), training_state())


def test_a_second_async_save_queues_behind_the_first(tmp_path, monkeypatch):
    """The first save's write is held until the second was submitted: the second must still land last."""
    import importlib
    writer = importlib.import_module("swapio.safetensors.writer")
    release = threading.Event()
    real = writer.write
    first = []

    def held(*args, **kwargs):
        if not first:
            first.append(1)
            assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write", held)
    path = tmp_path / "c.safetensors"
    f1 = swapio.checkpoint.async_save({"k": 1, "t": torch.full((1000,), 1.0)}, path)
    f2 = swapio.checkpoint.async_save({"k": 2, "t": torch.full((1000,), 2.0)}, path)
    assert not f1.done() and not f2.done()
    release.set()
    f2.wait(timeout=60)
    assert f1.done()  # finished before the second began
    assert swapio.checkpoint.load(path)["k"] == 2
    assert leftovers(tmp_path) == []


def test_wait_raises_the_error_of_a_failed_background_write(small_ext4_dir):
    path = small_ext4_dir / "c.safetensors"
    swapio.checkpoint.save({"k": 0}, path)
    fut = swapio.checkpoint.async_save({"w": torch.zeros(16 * MiB)}, path, staging_bytes=4 * MiB)
    with pytest.raises(OSError) as info:
        fut.wait(timeout=60)
    assert info.value.errno == errno.ENOSPC
    assert isinstance(fut.exception(), OSError)
    assert swapio.checkpoint.load(path) == {"k": 0}
    assert leftovers(small_ext4_dir) == []


def test_kept_buffers_are_reused_and_never_leak_an_earlier_save_into_a_later_one(tmp_path):
    """Each save reuses the last one's staging and capture memory: every file must still hold its own state."""
    import safetensors.torch as st
    from swapio.safetensors import buffers
    g = torch.Generator().manual_seed(7)
    states = [{"w": torch.randn(700_000, generator=g), "v": torch.randn(123_457, generator=g).bfloat16()}
              for _ in range(3)]
    swapio.checkpoint.async_save(states[0], tmp_path / "0.safetensors", staging_bytes=MiB).wait(timeout=60)
    kept = buffers._spare["image"].data_ptr()
    swapio.checkpoint.async_save(states[1], tmp_path / "1.safetensors", staging_bytes=MiB).wait(timeout=60)
    assert buffers._spare["image"].data_ptr() == kept  # the same memory served again
    swapio.checkpoint.save(states[2], tmp_path / "2.safetensors", staging_bytes=MiB)
    for i, state in enumerate(states):
        flat = st.load_file(str(tmp_path / f"{i}.safetensors"))
        assert torch.equal(flat["w"], state["w"]) and torch.equal(flat["v"], state["v"]), i
    swapio.checkpoint.release_buffers()
    assert buffers._spare == {}


def test_a_save_after_an_async_save_to_the_same_path_lands_last(tmp_path, monkeypatch):
    """save(B) called after async_save(A) must win even while A's write is still queued (no data loss)."""
    import importlib
    writer = importlib.import_module("swapio.safetensors.writer")
    real = writer.write
    first = []

    def held(*args, **kwargs):
        if not first:
            first.append(1)
            threading.Event().wait(0.5)  # the async write is slow
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write", held)
    path = tmp_path / "c.safetensors"
    fut = swapio.checkpoint.async_save({"k": "A", "t": torch.full((1000,), 1.0)}, path)
    swapio.checkpoint.save({"k": "B", "t": torch.full((10,), 2.0)}, path)
    assert fut.done()
    fut.wait(timeout=60)
    assert swapio.checkpoint.load(path)["k"] == "B"
    assert leftovers(tmp_path) == []


def test_at_most_one_capture_waits_behind_the_save_being_written(tmp_path, monkeypatch):
    """A third async_save while one is written and one waits blocks until the first is done (bounded memory)."""
    import importlib
    writer = importlib.import_module("swapio.safetensors.writer")
    release = threading.Event()
    real = writer.write

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write", held)
    path = tmp_path / "c.safetensors"
    futs = [swapio.checkpoint.async_save({"k": k, "t": torch.full((1000,), float(k))}, path) for k in (1, 2)]
    third = threading.Thread(target=lambda: futs.append(swapio.checkpoint.async_save({"k": 3}, path)))
    third.start()
    third.join(0.5)
    assert third.is_alive() and len(futs) == 2  # blocked: two captures are held already
    release.set()
    third.join(60)
    assert not third.is_alive()
    for f in futs:
        f.wait(timeout=60)
    assert swapio.checkpoint.load(path)["k"] == 3


def test_a_capture_holds_about_the_file_not_a_window_more(tmp_path):
    """The pinned block of an async_save's image is at most the file's size (a 64 MiB + header file once took a
    128 MiB block: 2x the state)."""
    from swapio.safetensors import buffers
    swapio.checkpoint.release_buffers()
    size = swapio.checkpoint.async_save({"v": torch.zeros(16 * MiB)}, tmp_path / "c.safetensors").wait(timeout=60)
    held = sum(t.numel() for t in buffers._spare.values())
    swapio.checkpoint.release_buffers()
    assert held <= size + 2 * 4096, (held, size)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_a_failed_commit_names_the_checkpoint_not_the_temporary_file(tmp_path, monkeypatch, asynchronous):
    """The path becomes a directory between the call and the commit (the rename fails with EISDIR)."""
    from swapio.safetensors import commit
    path = tmp_path / "c.safetensors"
    real = commit.PendingFile.commit

    def late_dir(self, size):
        os.mkdir(path)
        return real(self, size)

    monkeypatch.setattr(commit.PendingFile, "commit", late_dir)
    with pytest.raises(OSError) as info:
        if asynchronous:
            swapio.checkpoint.async_save({"a": torch.ones(10)}, path).wait(timeout=60)
        else:
            swapio.checkpoint.save({"a": torch.ones(10)}, path)
    assert info.value.errno == errno.EISDIR
    assert info.value.filename == str(path) and info.value.filename2 is None
    assert "swapio-ckpt" not in str(info.value.filename)
    assert leftovers(tmp_path) == []


def test_an_interrupt_right_after_the_capture_helper_started_leaves_no_helper_copying(tmp_path, monkeypatch):
    """A KeyboardInterrupt arriving right after Thread.start() launched the capture helper (its start was outside
    the try that joins it) left the helper copying into staging that async_save then released and the next save
    reuses: the helper is now always joined first."""
    import threading

    real_wait, armed = threading.Event.wait, [True]

    def wait(self, timeout=None):  # the main thread's first wait: Thread.start() of the capture helper
        result = real_wait(self, timeout)
        if armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            raise KeyboardInterrupt
        return result
    monkeypatch.setattr(threading.Event, "wait", wait)
    state = {f"t{i}": torch.randn(4 << 20) for i in range(8)}  # 128 MiB: the helper is still copying
    with pytest.raises(KeyboardInterrupt):
        swapio.checkpoint.async_save(state, tmp_path / "a.safetensors", staging_bytes=64 << 20)
    assert not any(t.name == "swapio-capture" and t.is_alive() for t in threading.enumerate())
    monkeypatch.setattr(threading.Event, "wait", real_wait)
    swapio.checkpoint.save(state, tmp_path / "a.safetensors")  # and the library goes on working
    got = swapio.checkpoint.load(tmp_path / "a.safetensors")
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_ctrl_c_in_the_callers_half_of_the_capture_wins_over_the_helpers_error(tmp_path, monkeypatch):
    """The capture copies half the bytes on the caller's thread and half on a helper; both halves' exceptions
    were kept in one list and the first raised, so a Ctrl-C on the caller's thread that came after the helper had
    failed was dropped for the helper's error. The caller's own Ctrl-C (or error) now propagates as it is."""
    from swapio.checkpoint import capture

    def copy(d, s):
        if threading.current_thread().name == "swapio-capture":
            raise RuntimeError("the helper's copy failed")
        for t in threading.enumerate():  # the helper has failed and recorded its error by now
            if t.name == "swapio-capture":
                t.join()
        raise KeyboardInterrupt

    monkeypatch.setattr(capture, "_copy", copy)
    state = {f"t{i}": torch.randn(1000) for i in range(4)}
    with pytest.raises(KeyboardInterrupt):
        swapio.checkpoint.async_save(state, tmp_path / "a.safetensors")
    monkeypatch.undo()
    assert not any(t.name == "swapio-capture" and t.is_alive() for t in threading.enumerate())
    swapio.checkpoint.async_save(state, tmp_path / "a.safetensors").wait()  # the next save works
    got = swapio.checkpoint.load(tmp_path / "a.safetensors")
    assert all(torch.equal(got[k], v) for k, v in state.items())
