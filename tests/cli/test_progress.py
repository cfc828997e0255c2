"""One progress rule for every command (swapio._progress): a bar only on a terminal, unless --progress or
SWAPIO_PROGRESS=1 asks for it, or -q / SWAPIO_PROGRESS=0 says no. `swapio demo` used to draw its bar (carriage
returns and all) into any stderr, logs and CI transcripts included."""
import io
import warnings

import pytest

from swapio import SwapioWarning, _env, _progress
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


@pytest.mark.parametrize("value", ["maybe", "2", "enabled"])
def test_an_unknown_env_value_warns_naming_it_and_the_accepted_ones(monkeypatch, value):
    """SWAPIO_PROGRESS=maybe used to be ignored without a word; it warns (as SWAPIO_CPU_CAPABILITY does), once per
    value, and the default rule applies."""
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv(_progress.ENV, value)
    with pytest.warns(SwapioWarning) as caught:
        assert _progress.wanted(stream=_Terminal()) is True
    message = str(caught[0].message)
    assert len(caught) == 1 and f"SWAPIO_PROGRESS={value!r}" in message
    assert all(word in message for word in ("1", "true", "yes", "on", "0", "false", "no", "off")), message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _progress.wanted(stream=io.StringIO()) is False  # said once: the next bar decides quietly
        assert _progress.wanted(True, stream=io.StringIO()) is True  # --progress: the variable is not read


@pytest.mark.parametrize("value", ["", " ON ", "No"])
def test_accepted_and_empty_env_values_do_not_warn(monkeypatch, value):
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv(_progress.ENV, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _progress.wanted(stream=io.StringIO()) is (value.strip().lower() == "on")


def test_the_command_says_once_that_it_ignores_an_unknown_env_value(capsys, monkeypatch):
    monkeypatch.setattr(_env, "_warned", set())
    monkeypatch.setenv(_progress.ENV, "sometimes")
    err = _tiny_demo(capsys)
    warned = [line for line in err.splitlines() if "SWAPIO_PROGRESS" in line]
    assert len(warned) == 1, err
    assert warned[0].startswith("swapio: warning: SWAPIO_PROGRESS='sometimes' is not one of"), err
