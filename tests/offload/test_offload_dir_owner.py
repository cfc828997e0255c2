"""An offload_dir belongs to one live model, and what a killed offload left there is reclaimed by the next user
of the directory, never while a live model uses it."""
import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from swapio.offload import disk_offload, remove_offload
from swapio.offload.api import _offloaded
from helpers.offload import assert_same_outputs, meta_model, reference, resident_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def data_files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("swapio-weights-"))


@pytest.mark.slow
def test_a_second_offload_into_a_live_directory_is_refused(tmp_path):
    a = disk_offload(resident_model(), tmp_path / "od")
    before = data_files(tmp_path / "od")
    b = resident_model()
    with pytest.raises(OSError) as info:
        disk_offload(b, tmp_path / "od")
    assert info.value.errno == errno.EBUSY and info.value.filename == str(tmp_path / "od")
    with pytest.raises(OSError) as info:  # reusing the index with a model on meta: the same directory, refused
        disk_offload(meta_model(), tmp_path / "od")
    assert info.value.errno == errno.EBUSY
    assert data_files(tmp_path / "od") == before  # a's weights are still there
    assert b not in _offloaded and b.transformer.wte.weight.device.type == "cpu"  # b untouched
    assert_same_outputs(a)
    remove_offload(a)
    assert_same_outputs(a)
    disk_offload(b, tmp_path / "od")  # free again once a let it go
    assert_same_outputs(b)
    remove_offload(b)


@pytest.mark.slow
def test_a_model_dropped_without_remove_offload_frees_its_directory(tmp_path):
    dropped = disk_offload(resident_model(), tmp_path / "od")
    with torch.no_grad():
        dropped(reference()[0][:, :3])  # reads ahead for the next forward are in flight when it is dropped
    fetcher = _offloaded[dropped].fetcher
    del dropped
    gc.collect()
    assert fetcher.ring._arena is None and not fetcher.fetches  # reads waited for, then the ring freed
    model = disk_offload(meta_model(), tmp_path / "od")  # reuses the weights it wrote
    assert_same_outputs(model)
    remove_offload(model)


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {repo!r})
    from swapio.offload import disk_offload
    model = disk_offload(torch.nn.Sequential(torch.nn.Linear(8, 8)), {directory!r})
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.mark.crash
def test_a_directory_in_use_by_another_process_is_refused_until_it_dies(tmp_path):
    directory = str(tmp_path / "od")
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO, directory=directory)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(OSError, match=rf"pid {child.pid}") as info:
            disk_offload(torch.nn.Sequential(torch.nn.Linear(8, 8)), directory)
        assert info.value.errno == errno.EBUSY
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    want = model(x)
    disk_offload(model, directory)  # the dead owner's claim is gone with it; its data file too (replaced)
    assert torch.equal(model(x), want)
    assert len(data_files(directory)) == 1
    remove_offload(model)


def plant_leftovers(directory):
    """What a swapio process killed inside disk_offload(offload_dir=directory) can leave there."""
    os.makedirs(directory, exist_ok=True)
    leftovers = [".swapio-weights-0123456789abcdef.bin.tmp", ".swapio-weights.json.0123456789abcdef.tmp",
                 "swapio-weights-fedcba9876543210.bin"]  # published, but killed before the index named it
    for name in leftovers:
        with open(os.path.join(directory, name), "wb") as f:
            f.truncate(1 << 20)
    with open(os.path.join(directory, ".swapio-owner"), "w") as f:
        f.write("999999999\n")  # the dead process's claim: a pid, no lock held
    return leftovers


def test_leftovers_of_a_killed_offload_are_reclaimed_by_the_next_writer(tmp_path):
    directory = tmp_path / "od"
    leftovers = plant_leftovers(directory)
    keep = directory / "notes.txt"  # not swapio's: never touched
    keep.write_text("mine")
    with pytest.warns(UserWarning, match="removed 3 file"):
        model = disk_offload(resident_model(), directory)
    names = set(os.listdir(directory))
    assert not names & set(leftovers)
    assert names == {"swapio-weights.json", ".swapio-owner", "notes.txt", *data_files(directory)}
    assert len(data_files(directory)) == 1 and keep.read_text() == "mine"
    remove_offload(model)
    assert ".swapio-owner" not in os.listdir(directory)  # given up with the model


def test_leftovers_are_reclaimed_when_a_model_reuses_the_directory(tmp_path):
    directory = tmp_path / "od"
    remove_offload(disk_offload(resident_model(), directory))
    committed = data_files(directory)
    leftovers = plant_leftovers(directory)
    model = disk_offload(meta_model(), directory)
    assert data_files(directory) == committed and not set(os.listdir(directory)) & set(leftovers)
    assert_same_outputs(model)
    remove_offload(model)


@pytest.mark.slow
def test_leftovers_are_not_touched_while_a_live_model_uses_the_directory(tmp_path):
    directory = tmp_path / "od"
    model = disk_offload(resident_model(), directory)
    tmp = directory / ".swapio-weights-0123456789abcdef.bin.tmp"  # as if the live model's process were writing it
    tmp.write_bytes(b"x" * 4096)
    with pytest.raises(OSError):
        disk_offload(resident_model(), directory)
    assert tmp.exists()
    assert_same_outputs(model)
    remove_offload(model)


@pytest.mark.parametrize("index, match", [("{not json", "not valid JSON"),
                                          ("[" * 100000 + "]" * 100000, "nests deeper")],  # was a RecursionError
                         ids=["not-json", "deeply-nested"])
def test_an_unreadable_index_keeps_every_data_file(tmp_path, index, match):
    directory = tmp_path / "od"
    remove_offload(disk_offload(resident_model(), directory))
    committed = data_files(directory)
    (directory / "swapio-weights.json").write_text(index)
    with pytest.raises(ValueError, match=f"swapio-weights.json: (the JSON )?{match}"):
        disk_offload(meta_model(), directory)
    assert data_files(directory) == committed  # which data the index meant cannot be told: nothing removed


def test_a_claim_dropped_by_a_ctrl_c_before_the_model_holds_it_is_given_up(tmp_path, monkeypatch):
    """Ctrl-C can land between taking the directory's claim and storing it anywhere."""
    from swapio.offload import dir_owner
    real = dir_owner.claim

    def claim_then_ctrl_c(directory):
        real(directory)  # taken, and dropped at once
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(dir_owner, "claim", claim_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            disk_offload(resident_model(), tmp_path / "od")
    model = disk_offload(resident_model(), tmp_path / "od")
    assert_same_outputs(model)
    remove_offload(model)
