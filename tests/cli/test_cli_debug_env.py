"""SWAPIO_DEBUG reads its value as SWAPIO_PROGRESS does (swapio._env): 1/true/yes/on shows tracebacks, 0/false/
no/off and unset keep one-line errors, anything else warns and keeps them. Any non-empty value used to count, so
SWAPIO_DEBUG=0 turned tracebacks on."""
import pytest

from swapio import _env
from swapio.tools import cli
from helpers.cli import run_cli


@pytest.fixture(autouse=True)
def failing_info(monkeypatch):
    """`swapio info` fails as an unexpected bug would."""
    def boom(args):
        raise RuntimeError("an unexpected failure")
    monkeypatch.setattr(cli, "_run_info", boom)
    monkeypatch.setattr(_env, "_warned", set())


@pytest.mark.parametrize("value", ["", "0", "false", "No", " off "])
def test_off_values_keep_the_one_line_error(capsys, monkeypatch, value):
    monkeypatch.setenv("SWAPIO_DEBUG", value)
    rc, _, err = run_cli(capsys, "info")
    assert rc == 1
    assert err.splitlines() == ["swapio info: internal error: RuntimeError: an unexpected failure (SWAPIO_DEBUG=1 "
                                "shows the traceback)"]


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_on_values_show_the_traceback(capsys, monkeypatch, value):
    monkeypatch.setenv("SWAPIO_DEBUG", value)
    with pytest.raises(RuntimeError, match="an unexpected failure"):
        cli.main(["info"])


def test_an_unknown_value_warns_and_keeps_the_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("SWAPIO_DEBUG", "verbose")
    rc, _, err = run_cli(capsys, "info")
    lines = err.splitlines()
    assert rc == 1 and len(lines) == 2, err
    assert lines[0].startswith("swapio: warning: SWAPIO_DEBUG='verbose' is not one of 1, true, yes, on"), err
    assert lines[0].endswith("ignored: one-line errors, no tracebacks"), err
    assert lines[1].startswith("swapio info: internal error: RuntimeError")
