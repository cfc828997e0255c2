"""A read in flight keeps its destination memory alive even when the tensor is given other memory meanwhile
(t.set_(...), t.data = ...): the future held the tensor object, not its storage, so the read landed in freed
memory that later tensors were given (silently changed bytes, or a corrupted heap and a crash; so the scenario
runs in a child process). Reference: the zeros the later tensors were created with."""
import textwrap

import pytest

from conftest import run_python

SCENARIO = textwrap.dedent("""
    import sys, torch, swapio
    path, replace = sys.argv[1], sys.argv[2]
    nbytes = 64 << 10
    # a single-slot psync worker runs requests in order: the small read waits behind 64 MiB of 4 KiB reads
    h = swapio.AioHandle(engine="psync", block_size=4096, queue_depth=1, threads=1, direct=False)
    with open(path + ".big", "wb") as f:
        f.truncate(64 << 20)
    with open(path, "wb") as f:
        f.write(b"s" * nbytes)
    big = h.pread(torch.empty(64 << 20, dtype=torch.uint8), path + ".big")
    out = torch.empty(nbytes, dtype=torch.uint8)
    queued = h.pread(out, path)
    if replace == "set_":
        out.set_(torch.empty(0, dtype=torch.uint8))
    else:
        out.data = torch.empty(0, dtype=torch.uint8)
    later = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(32)]
    big.wait(60)
    assert queued.wait(60) == nbytes
    print(sum(int(t.count_nonzero()) for t in later))
    h.close()
""")


@pytest.mark.parametrize("replace", ["set_", "data="])
def test_a_read_lands_in_the_memory_it_was_given_not_in_later_tensors(tmp_path, replace):
    proc = run_python(SCENARIO, str(tmp_path / "small.bin"), replace)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0"]  # no byte of the read reached a later tensor
