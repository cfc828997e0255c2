"""One tensor swapped out twice (under two names, or once with release=False as a backup): the first wait()
that releases the storage waits for the other write still reading it. It freed the memory under that write: the
worker crashed (SIGSEGV) or that write failed (EFAULT); so the scenario runs in a child process. Reference: a
clone of the tensor taken before."""
import textwrap

import pytest

from conftest import run_python

SCENARIO = textwrap.dedent("""
    import sys, torch, swapio
    directory, second_release = sys.argv[1], sys.argv[2] == "both-release"
    # a single-slot psync worker in 4 KiB pieces: the second write is still running when the first one is waited
    store = swapio.SwapStore(directory, engine="psync", block_size=4096, queue_depth=1, direct=False)
    t = torch.randn(4 << 20)
    expected = t.clone()
    a = store.swap_out(t, name="a")  # release=True: its wait() frees t's storage
    b = store.swap_out(t, name="b", release=second_release)
    a.wait(60)
    b.wait(60)
    ok = []
    for s in (a, b):
        ok.append(torch.equal(s.swap_in(out=torch.empty_like(expected)).wait(60), expected))
    print(ok)
    store.close()
""")


@pytest.mark.parametrize("second", ["both-release", "second-keeps"])
def test_releasing_waits_for_the_other_write_of_the_same_memory(tmp_path, second):
    proc = run_python(SCENARIO, str(tmp_path / "swap"), second)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[True,", "True]"]
