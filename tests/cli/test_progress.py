"""One progress rule for every command (swapio._progress): a bar only on a terminal, unless --progress or
SWAPIO_PROGRESS=1 asks for it, or -q / SWAPIO_PROGRESS=0 says no. `swapio demo` used to draw its bar (carriage
returns and all) into any stderr, logs and CI transcripts included."""
import io

import pytest

from swapio import _progress
from helpers.cli import run_cli


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def _no_env_default(monkeypatch, tmp_path):
    monkeypatch.delenv(_progress.ENV, raising=False)
    monkeypatch.chdir(tmp_path)


def test_rule(monkeypatch):
    assert _progress.wanted(stream=_Terminal()) is True
    assert _progress.wanted(stream=io.StringIO()) is False          # a file, a pipe: no bar
    assert _progress.wanted(True, stream=io.StringIO()) is True     # --progress
    assert _progress.wanted(False, stream=_Terminal()) is False     # -q
    monkeypatch.setenv(_progress.ENV, "1")
    assert _progress.wanted(stream=io.StringIO()) is True
    assert _progress.wanted(False, stream=io.StringIO()) is False   # the flag beats the environment
    monkeypatch.setenv(_progress.ENV, "off")
    assert _progress.wanted(stream=_Terminal()) is False
    assert _progress.bar(False, total=3) is None


def _tiny_demo(capsys, *flags):
    rc, out, err = run_cli(capsys, "demo", "--steps", "2", "--layers", "1", "--width", "16", "--heads", "2",
                           "--context", "8", "--batch", "2", "--log-every", "1", "--buffer", "256K", *flags)
    assert rc == 0, err
    return err


def test_demo_draws_no_bar_into_a_log(capsys):
    err = _tiny_demo(capsys)  # capsys: stderr is not a terminal
    assert "\r" not in err and "swapio demo" not in err


@pytest.mark.slow
def test_demo_draws_the_bar_when_asked(capsys, monkeypatch):
    assert "swapio demo" in _tiny_demo(capsys, "--progress")
    monkeypatch.setenv(_progress.ENV, "1")
    assert "swapio demo" in _tiny_demo(capsys)
    assert "swapio demo" not in _tiny_demo(capsys, "-q")


@pytest.mark.parametrize("command", ["bench", "tune", "demo"])
def test_every_command_takes_progress_and_quiet_but_not_both(capsys, command):
    rc, _, err = run_cli(capsys, command, "--progress", "-q")
    assert rc == 2 and "not allowed with" in err
