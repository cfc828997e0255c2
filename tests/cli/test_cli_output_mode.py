"""An --output / -o file the command replaces keeps its permissions (and, where the process may give them, its
owner and group), as `cp` over a file keeps them; a new file gets the umask's default. The output goes through a
temporary file and a rename, and that new file took the umask's mode: a 0600 config became 0644 (world-readable)
at the next `swapio tune`."""
import os
import stat

import pytest

from helpers.cli import leftovers, run_cli

QUICK_BENCH = ["bench", "-q", "--json", "--engine", "null", "--size", "256K", "--bs", "64K", "--output"]
QUICK_TUNE = ["tune", "-q", "--size", "1M", "--engines", "psync", "--bs", "256K", "--iodepth", "1", "--threads", "1",
              "--point-time", "10ms", "--warmup", "0", "--budget", "0.1", "-o"]
COMMANDS = {"bench --output": QUICK_BENCH, "tune -o": QUICK_TUNE}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def umask():
    def set_umask(mask):
        os.umask(mask)
    old = os.umask(0o022)
    yield set_umask
    os.umask(old)


def mode_of(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("old_mode, mask", [(0o600, 0o022), (0o664, 0o022), (0o644, 0o077), (0o444, 0o022)],
                         ids=lambda mode: f"{mode:04o}")
def test_a_replaced_output_keeps_its_mode(capsys, tmp_path, umask, command, old_mode, mask):
    out = tmp_path / "out.json"
    out.write_text("old\n")
    out.chmod(old_mode)
    umask(mask)
    rc, _, err = run_cli(capsys, *COMMANDS[command], str(out))
    assert rc == 0, err
    assert out.read_text() != "old\n"
    assert mode_of(out) == old_mode, oct(mode_of(out))
    assert leftovers(tmp_path) == ["out.json"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_new_output_gets_the_umask_default(capsys, tmp_path, umask, command):
    umask(0o027)
    rc, _, err = run_cli(capsys, *COMMANDS[command], str(tmp_path / "new.json"))
    assert rc == 0, err
    assert mode_of(tmp_path / "new.json") == 0o640


def test_the_target_of_a_symlink_keeps_its_mode(capsys, tmp_path, umask):
    target = tmp_path / "results.json"
    target.write_text("old\n")
    target.chmod(0o600)
    (tmp_path / "latest.json").symlink_to(target)
    rc, _, err = run_cli(capsys, *QUICK_BENCH, str(tmp_path / "latest.json"))
    assert rc == 0, err
    assert (tmp_path / "latest.json").is_symlink() and mode_of(target) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_as_root_a_replaced_output_keeps_its_owner_and_group(capsys, tmp_path):
    out = tmp_path / "out.json"
    out.write_text("old\n")
    os.chown(out, 4321, 4322)
    rc, _, err = run_cli(capsys, *QUICK_BENCH, str(out))
    assert rc == 0, err
    st = os.stat(out)
    assert (st.st_uid, st.st_gid) == (4321, 4322)
