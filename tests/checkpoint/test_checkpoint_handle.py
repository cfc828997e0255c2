"""The handle saves and loads share (swapio.safetensors.buffers.handle_for): kept for the next call after a clean
one, closed after an error or an interruption, never shared by two calls at once, dead ones (closed, inherited
through fork()) replaced, closed by release_buffers()."""
import hashlib
import importlib
import multiprocessing
import threading

import pytest
import torch

import swapio
import swapio.checkpoint as ckpt

buffers = importlib.import_module("swapio.safetensors.buffers")
load_module = importlib.import_module("swapio.checkpoint.load")


@pytest.fixture
def made(monkeypatch):
    """The handles handle_for creates, in order (the kept ones released before and after)."""
    ckpt.release_buffers()
    handles, real = [], buffers.new_handle

    def counting():
        handles.append(real())
        return handles[-1]
    monkeypatch.setattr(buffers, "new_handle", counting)
    yield handles
    ckpt.release_buffers()


def state():
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(7, generator=g), "step": 3}


def assert_same(got, want):
    assert got["step"] == want["step"]
    for k in ("w", "b"):
        assert torch.equal(got[k], want[k])


def test_saves_and_loads_reuse_one_handle_until_released(tmp_path, made):
    s = state()
    for i in range(3):
        ckpt.save(s, tmp_path / f"{i}.safetensors")
        assert_same(ckpt.load(tmp_path / f"{i}.safetensors"), s)
    assert len(made) == 1 and not made[0].closed
    ckpt.release_buffers()
    assert made[0].closed
    assert_same(ckpt.load(tmp_path / "0.safetensors"), s)
    assert len(made) == 2


def test_a_given_handle_is_used_and_left_open(tmp_path, made):
    s = state()
    with swapio.AioHandle(threads=2) as h:
        ckpt.save(s, tmp_path / "a.safetensors", handle=h)
        assert_same(ckpt.load(tmp_path / "a.safetensors", handle=h), s)
        assert not h.closed
    assert made == []


def test_an_interrupted_load_closes_its_handle_and_the_next_gets_a_new_one(tmp_path, made, monkeypatch):
    s = state()
    ckpt.save(s, tmp_path / "a.safetensors")
    real = load_module.read_into

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(load_module, "read_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.load(tmp_path / "a.safetensors")  # "b" (small) is streamed by read_into: interrupted there
    assert made[0].closed
    monkeypatch.setattr(load_module, "read_into", real)
    assert_same(ckpt.load(tmp_path / "a.safetensors"), s)
    assert len(made) == 2 and not made[1].closed


def test_concurrent_loads_use_their_own_handles_and_one_is_kept(tmp_path, made):
    s = state()
    ckpt.save(s, tmp_path / "a.safetensors")
    ckpt.release_buffers()
    made.clear()
    inside, results, errors = threading.Barrier(2), [], []
    real = load_module.read_into

    def slow(*a, **k):
        inside.wait(timeout=30)  # both loads hold a handle at this point
        return real(*a, **k)
    load_module.read_into = slow
    try:
        def run():
            try:
                results.append(ckpt.load(tmp_path / "a.safetensors"))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        load_module.read_into = real
    assert errors == [] and len(results) == 2
    for r in results:
        assert_same(r, s)
    assert len(made) == 2 and made[0] is not made[1]
    assert sorted(h.closed for h in made) == [False, True]  # one kept, the other closed


def _digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _load_in_child(path, want, queue):
    """(No torch compute in the child: torch's OpenMP pool, used by the parent, does not survive fork().)"""
    try:
        queue.put(_digest(ckpt.load(path)["w"]) == want)
    except BaseException as exc:  # noqa: BLE001
        queue.put(repr(exc))


def test_a_forked_child_replaces_the_kept_handle_it_inherited(tmp_path, made):
    s = state()
    ckpt.save(s, tmp_path / "a.safetensors")
    assert len(made) == 1 and not made[0].closed  # kept, and inherited by the child
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_in_child, args=(str(tmp_path / "a.safetensors"), _digest(s["w"]), queue))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) is True
