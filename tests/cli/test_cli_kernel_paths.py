"""Paths on /sys and /proc, and a device where a file or directory belongs: bad usage (exit 2, one line), refused
before any work. Whether a file can be created in a directory used to be asked of os.access, which says yes to
root everywhere: `swapio info --path /sys`, `bench --dir /sys`, `plan --disk /proc`, `bench --output /sys/x`
(after the whole run) failed with status 1 and a bare "Permission denied: /sys/.swapio-probe-...".
These run as root in CI; as another user os.access already said no. An output path under a regular file was
said to be under a directory that does not exist."""
import os

import pytest

from helpers.cli import assert_one_line_error, leftovers, run_cli

TINY_BENCH = ["bench", "-q", "--size", "1M", "--bs", "256K", "--engine", "psync"]
TINY_TUNE = ["tune", "-q", "--size", "1M", "--engines", "psync", "--bs", "256K", "--iodepth", "1", "--threads",
             "1", "--point-time", "10ms", "--warmup", "0", "--budget", "0.1"]
TINY_DEMO = ["demo", "-q", "--steps", "1", "--layers", "1", "--width", "16", "--heads", "2", "--context", "8",
             "--batch", "2", "--buffer", "256K"]

# (argv, where "{tmp}" is the test's directory; the words the one-line error must hold)
CASES = [
    (["info", "--path", "/sys"], "--path /sys is a directory that is not writable"),
    (["info", "--path", "/proc"], "--path /proc is a directory that is not writable"),
    (["info", "--path", "/dev/null"], "--path /dev/null is neither a regular file nor a directory"),
    ([*TINY_BENCH, "--dir", "/sys"], "--dir /sys is not writable"),
    ([*TINY_BENCH, "--dir", "/proc"], "--dir /proc is not writable"),
    ([*TINY_BENCH, "--file", "/proc/swapio-never-made"], "--file's directory /proc is not writable"),
    ([*TINY_BENCH, "--dir", "{tmp}", "--output", "/sys/swapio-never-made.json"], "directory /sys is not writable"),
    ([*TINY_TUNE, "--dir", "/sys", "-o", "{tmp}/c.json"], "--dir /sys is not writable"),
    ([*TINY_TUNE, "--dir", "{tmp}", "-o", "/proc/swapio-never-made.json"], "directory /proc is not writable"),
    (["plan", "--params", "1B", "--disk", "/proc"], "--disk /proc is not writable"),
    ([*TINY_DEMO, "--dir", "/sys"], "--dir /sys is not writable"),
    ([*TINY_DEMO, "--dir", "{tmp}", "--plot", "/sys/swapio-never-made.png"], "directory /sys is not writable"),
]


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_kernel_file_system_or_a_device_is_a_usage_error(capsys, tmp_path, monkeypatch, argv, needle):
    for top in ("/sys", "/proc"):
        if top in " ".join(argv) and not os.path.isdir(os.path.join(top, "kernel" if top == "/sys" else "self")):
            pytest.skip(f"{top} is not mounted here")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert_one_line_error(rc, err, needle)
    assert rc == 2
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("argv", [["bench", "-q", "--size", "1M", "--output"], ["tune", "-q", "-o"],
                                  ["tune", "-q", "--plot"], ["demo", "-q", "--plot"]])
def test_an_output_under_a_file_names_the_file_as_no_directory(capsys, tmp_path, monkeypatch, argv):
    # it said "directory .../notes.txt does not exist" of a file that does
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    rc, _, err = run_cli(capsys, *argv, str(tmp_path / "notes.txt" / "out"))
    assert_one_line_error(rc, err, f"{tmp_path / 'notes.txt'} is not a directory")
    assert rc == 2
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
