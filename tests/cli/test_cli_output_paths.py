"""--output / -o / --plot paths that are not plain new files: a symlink is followed, a device or FIFO is written in
place. (Renaming a temporary file over them replaced the link, the pipe or, as root, /dev/null itself.)"""
import json
import os
import stat
import threading

import pytest

from helpers.cli import leftovers, run_cli

QUICK_BENCH = ("bench", "-q", "--json", "--engine", "null", "--size", "256K", "--bs", "64K")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_output_through_a_symlink_writes_its_target_and_keeps_the_link(capsys, tmp_path):
    (tmp_path / "results").mkdir()
    target = tmp_path / "results" / "bench.json"
    target.write_text("old\n")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    rc, out, err = run_cli(capsys, *QUICK_BENCH, "--output", str(link))
    assert rc == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["jobs"][0]["swapio"]["engine"] == "null"
    assert leftovers(tmp_path) == ["latest.json", "results"]
    assert os.listdir(tmp_path / "results") == ["bench.json"]


def test_output_through_a_dangling_symlink_creates_its_target(capsys, tmp_path):
    (tmp_path / "results").mkdir()
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "results" / "new.json")
    rc, _, err = run_cli(capsys, *QUICK_BENCH, "--output", str(link))
    assert rc == 0, err
    assert link.is_symlink() and json.loads((tmp_path / "results" / "new.json").read_text())["jobs"]


def test_output_through_a_symlink_into_a_missing_directory_is_a_usage_error(capsys, tmp_path):
    link = tmp_path / "latest.json"
    link.symlink_to("/nonexistent/swapio/out.json")
    rc, _, err = run_cli(capsys, *QUICK_BENCH, "--output", str(link))
    assert rc == 2 and "/nonexistent/swapio does not exist" in err, err
    assert link.is_symlink()


def test_output_to_a_symlink_to_dev_null_leaves_the_device_alone(capsys, tmp_path):
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    rc, _, err = run_cli(capsys, *QUICK_BENCH, "--output", str(link))
    assert rc == 0, err
    assert link.is_symlink()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert leftovers(tmp_path) == ["null"]


def test_output_to_a_fifo_is_written_into_the_pipe(capsys, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    rc, _, err = run_cli(capsys, *QUICK_BENCH, "--output", str(fifo))
    reader.join(5)
    assert rc == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the pipe, not a file put in its place
    assert json.loads(received[0])["jobs"][0]["swapio"]["engine"] == "null"
    assert leftovers(tmp_path) == ["pipe"]


@pytest.mark.parametrize("argv", [["tune", "-o", ""], ["tune", "--plot", " "], ["bench", "--output", ""],
                                  ["demo", "--plot", ""]])
def test_an_empty_output_path_is_a_usage_error(capsys, tmp_path, argv):
    # tune -o "" swept for seconds, then failed renaming its temporary file over the working directory (exit 1);
    # bench --output "" printed to stdout as if no --output had been given
    rc, _, err = run_cli(capsys, *argv, "-q", "--size", "1M") if argv[0] != "demo" else run_cli(capsys, *argv, "-q")
    assert rc == 2 and "is empty: name a file" in err, err
    assert leftovers(tmp_path) == []
