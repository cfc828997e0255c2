"""Ctrl-C in async_save's queueing. Landing as it took its place in the queue (one of two: the save being
written and one waiting), before it held the place to give back: the place was lost for good, and after two such
interrupts every later async_save waited forever. Landing after the save became the last one, before its thread
started: every later save (and the exit) waited forever for a save that never ran. Each Ctrl-C is now raised
once the bookkeeping is whole."""
import os
import signal
import threading

import pytest
import torch

import swapio
import swapio.checkpoint.background as background
from conftest import TIMEOUT
from helpers.checkpoint import leftovers

pytestmark = pytest.mark.usefixtures("ctrl_c_raises")  # real SIGINTs raise even under an ignoring runner


def assert_a_later_save_works(tmp_path, hang_message):
    """An async_save after the interrupted ones finishes (in a thread: a hang fails with hang_message), writes its
    file, and nothing else is left in tmp_path."""
    done = {}

    def save():
        done["size"] = swapio.checkpoint.async_save({"t": torch.ones(10)}, tmp_path / "c.safetensors").wait()

    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    saver.join(TIMEOUT)
    assert not saver.is_alive(), hang_message
    assert done["size"] > 0
    assert torch.equal(swapio.checkpoint.load(tmp_path / "c.safetensors")["t"], torch.ones(10))
    assert leftovers(tmp_path) == []


def test_ctrl_c_as_async_save_takes_its_place_loses_no_place(tmp_path, monkeypatch):
    semaphore = background._slots
    real = type(semaphore).acquire

    def acquire_then_ctrl_c(self, *args, **kwargs):  # the SIGINT arrives as the place is taken
        got = real(self, *args, **kwargs)
        if got:
            os.kill(os.getpid(), signal.SIGINT)
        return got

    monkeypatch.setattr(type(semaphore), "acquire", acquire_then_ctrl_c)
    for _ in range(background.QUEUED):
        with pytest.raises(KeyboardInterrupt):
            swapio.checkpoint.async_save({"t": torch.ones(10)}, tmp_path / "interrupted.safetensors")
    monkeypatch.undo()
    assert_a_later_save_works(tmp_path, "async_save waited for a place the interrupted calls had lost")
    assert not os.path.exists(tmp_path / "interrupted.safetensors")


def test_ctrl_c_as_async_save_starts_its_writer_leaves_later_saves_working(tmp_path, monkeypatch):
    real = background.start_shielded

    def ctrl_c_then_start(thread):  # the SIGINT arrives once the save is the last one, before its thread starts
        os.kill(os.getpid(), signal.SIGINT)
        real(thread)

    monkeypatch.setattr(background, "start_shielded", ctrl_c_then_start)
    with pytest.raises(KeyboardInterrupt):
        swapio.checkpoint.async_save({"t": torch.zeros(10)}, tmp_path / "interrupted.safetensors")
    monkeypatch.undo()
    assert_a_later_save_works(tmp_path, "async_save waited for a save whose thread never started")
