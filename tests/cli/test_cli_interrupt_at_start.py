"""Ctrl-C in the first seconds of the `swapio` command, while `import swapio` loads torch (or the command loads its
own modules): one line and exit status 130, as later in the run. It used to print torch's import traceback.

The child is the real command line (`python -m swapio info`, or a copy of the script pip installs), with one
addition through a sitecustomize module on PYTHONPATH: when the import of the chosen module starts, it writes a
byte to a pipe and waits there, so the test's SIGINT lands inside that import, every time."""
import os
import signal
import sys
import textwrap

import pytest

from helpers.cli import signal_once_ready

pytestmark = pytest.mark.crash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 60

STALL = textwrap.dedent("""
    import os, sys, time

    class StallImport:
        def find_spec(self, name, path=None, target=None):
            if name == os.environ["STALL_MODULE"]:
                sys.meta_path.remove(self)
                os.write(int(os.environ["STALL_FD"]), b"r")
                time.sleep(%d)  # the signal comes here
            return None

    sys.meta_path.insert(0, StallImport())
""" % TIMEOUT)

# what `pip install` writes as the `swapio` script ([project.scripts] in pyproject.toml)
SCRIPT = textwrap.dedent("""
    import re
    import sys
    from swapio.tools.entry import main
    if __name__ == '__main__':
        sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
        sys.exit(main())
""")


def interrupt_while_importing(tmp_path, module, argv):
    """Runs argv with the import of `module` stalled, sends SIGINT there; returns (status, stderr)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALL)

    def start(fd):
        env = dict(os.environ, STALL_MODULE=module, STALL_FD=str(fd),
                   PYTHONPATH=os.pathsep.join([ROOT, str(hook), os.environ.get("PYTHONPATH", "")]))
        env.pop("SWAPIO_DEBUG", None)
        return argv, env

    return signal_once_ready(start, signal.SIGINT, TIMEOUT, cwd=tmp_path)


def command_line(tmp_path, form):
    if form == "python -m swapio":
        return [sys.executable, "-m", "swapio", "info"]
    script = tmp_path / "bin" / "swapio"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    return [sys.executable, str(script), "info"]


@pytest.mark.parametrize("form", ["python -m swapio", "the swapio script"])
@pytest.mark.parametrize("module", ["torch", "swapio.tools.cli"])  # import swapio; the command's own modules
def test_ctrl_c_while_the_command_imports_exits_130_without_a_traceback(tmp_path, form, module):
    status, err = interrupt_while_importing(tmp_path, module, command_line(tmp_path, form))
    assert status == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines() == ["swapio: interrupted"]


def test_a_program_importing_swapio_keeps_its_keyboard_interrupt(tmp_path):
    """Only the command exits quietly: another program's Ctrl-C during `import swapio` is its KeyboardInterrupt."""
    program = "try:\n    import swapio\nexcept KeyboardInterrupt:\n    raise SystemExit(7)\n"
    status, err = interrupt_while_importing(tmp_path, "torch", [sys.executable, "-c", program])
    assert status == 7, err
    assert "interrupted" not in err
