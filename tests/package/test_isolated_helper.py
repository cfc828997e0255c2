"""helpers/isolated.py: a child that ends by the interpreter fault (a trace callback that is not callable, called
as a function is entered) runs once more; any other failure, or the fault twice, fails at once."""
import os
import sys

import pytest

from helpers.isolated import run_isolated


def fault_once(marker):
    """Ends as the interpreter fault does on its first run: the trace callback is an object that is not callable."""
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    sys.settrace([])  # CPython calls it as the next function is entered: "TypeError: 'list' object is not callable"
    entered()


def operator_fault_once(marker):
    """The same fault where a tensor operator called a hook: torch reports the TypeError as its own."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise TypeError("unsupported operand type(s) for *: 'Tensor' and 'Tensor'")


def entered():
    return 1


def fault_always():
    sys.settrace(())
    entered()


def fail_once(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise AssertionError("a real failure")


@pytest.mark.parametrize("child, says", [("fault_once", "'list' object is not callable"),
                                         ("operator_fault_once", "'Tensor' and 'Tensor'")])
def test_the_interpreter_fault_runs_once_more_and_passes(tmp_path, capsys, child, says):
    run_isolated(__file__, child, str(tmp_path / "ran"))
    assert says in capsys.readouterr().out


def test_the_fault_twice_fails():
    with pytest.raises(AssertionError, match="(?s)run 2.*'tuple' object is not callable"):
        run_isolated(__file__, "fault_always")


def test_any_other_failure_fails_at_once(tmp_path):
    with pytest.raises(AssertionError, match="(?s)run 1.*a real failure"):
        run_isolated(__file__, "fail_once", str(tmp_path / "ran"))
