"""run_isolated: a test's body in a fresh interpreter, for the fd_audit sweeps that need one.

The sweeps raise their injected interrupt from a sys.settrace trace function. Through the activation offload's
hooks (which run under torch.compiler.disable, i.e. torch's frame evaluator) CPython 3.11 rarely ends up calling a
trace function that was freed: on a loaded machine, about one run in twenty-five, a traced function is entered with
a TypeError such as "'list' object is not callable" (the freed object's memory reused), or the interpreter
segfaults. Where a saved-tensor hook was entered, torch turns that TypeError into NotImplemented, and the
operator's own "unsupported operand type(s) for *: 'Tensor' and 'Tensor'" is what surfaces. None of these can
come from the code under test: what fails is the interpreter's call of its trace callback. fd_audit now keeps
every trace function alive; should a run still end so, it is tried once more, in a fresh interpreter. Any other
failure, or the same fault twice, fails the test with the child's output.
"""
import os
import re
import signal
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

# The end of a traceback whose last frame is a function being entered (its "def" line, then a line of carets or
# none) and whose error is that the interpreter's trace callback was not callable; or that TypeError as a tensor
# operator reports it.
_FREED_TRACE_FUNCTION = re.compile(r"\n\s+(async )?def [^\n]*\n([ \t~^]*\n)?TypeError: '\w+' object is not callable\n"
                                   r"|\nTypeError: unsupported operand type\(s\) for \S+: 'Tensor' and 'Tensor'\n")

# gc.freeze() as conftest.py does: the sweeps' gc.collect() calls then skip what the imports made
CHILD = """
import gc, importlib.util, sys
sys.path[:0] = [{here!r}, {tests!r}, {repo!r}]
spec = importlib.util.spec_from_file_location("isolated_test_module", {path!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
gc.collect()
gc.freeze()
module.{function}(*{args!r})
"""


def interpreter_fault(returncode, output):
    """Whether a child ended by the interpreter fault described above (a segfault, or the TypeError on entry)."""
    return returncode == -signal.SIGSEGV or bool(_FREED_TRACE_FUNCTION.search(output))


def run_isolated(test_file, function, *args, timeout=600):
    """Runs `function(*args)` of the module at test_file in a fresh interpreter (args: literals); AssertionError
    with the child's output if it fails (see the module for the one retry)."""
    code = CHILD.format(here=os.path.dirname(os.path.abspath(test_file)), tests=TESTS, repo=REPO,
                        path=os.path.abspath(test_file), function=function, args=tuple(args))
    for attempt in (1, 2):
        out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=REPO, capture_output=True,
                             text=True, timeout=timeout)
        if out.returncode == 0:
            return
        output = out.stdout[-4000:] + out.stderr[-6000:]
        if attempt == 2 or not interpreter_fault(out.returncode, out.stdout + out.stderr):
            raise AssertionError(f"{function} failed in its child (exit status {out.returncode}, run {attempt}):\n"
                                 f"{output}")
        print(f"{function}: run {attempt} ended by the interpreter fault of helpers/isolated.py; once more:\n{output}")
