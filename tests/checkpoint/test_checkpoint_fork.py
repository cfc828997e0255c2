"""fork() while async_save writes in the background (DataLoader workers and multiprocessing pools fork like this):
the child's own saves and loads work at once, the parent's futures say they are the parent's instead of
blocking, and the parent's saves finish as if nothing happened."""
import importlib
import threading

import pytest
import torch

import swapio
from helpers.checkpoint import assert_same, leftovers
from conftest import TIMEOUT
from helpers.fork import run_in_child

writer = importlib.import_module("swapio.safetensors.writer")


def state(k):
    return {"k": k, "t": torch.full((1000,), float(k))}


@pytest.mark.parametrize("in_flight", [1, 2], ids=["one-save", "queue-full"])
def test_a_child_forked_while_async_save_writes_saves_and_loads(tmp_path, monkeypatch, in_flight):
    release, real, held = threading.Event(), writer.write, []

    def write_held(*args, **kwargs):  # the parent's first write waits until the child is done
        if not held:
            held.append(1)
            assert release.wait(TIMEOUT)
        return real(*args, **kwargs)
    monkeypatch.setattr(writer, "write", write_held)
    futures = [swapio.checkpoint.async_save(state(k), tmp_path / f"parent{k}.safetensors") for k in range(in_flight)]
    assert not any(f.done() for f in futures)

    def child():
        assert swapio.checkpoint.save(state(10), tmp_path / "child.safetensors") > 0
        assert_same(swapio.checkpoint.load(tmp_path / "child.safetensors"), state(10))
        fut = swapio.checkpoint.async_save(state(11), tmp_path / "child-async.safetensors")
        assert fut.wait(timeout=TIMEOUT) > 0
        assert_same(swapio.checkpoint.load(tmp_path / "child-async.safetensors"), state(11))
        for f in futures:  # the parent's saves are not this process's to wait for
            with pytest.raises(RuntimeError, match="fork"):
                f.wait(timeout=TIMEOUT)

    assert run_in_child(child) == 0
    release.set()
    for k, f in enumerate(futures):
        assert f.wait(timeout=TIMEOUT) > 0
        assert_same(swapio.checkpoint.load(tmp_path / f"parent{k}.safetensors"), state(k))
    assert_same(swapio.checkpoint.load(tmp_path / "child-async.safetensors"), state(11))
    assert leftovers(tmp_path) == []
