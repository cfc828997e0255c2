"""Shared pieces of the tests that spawn a gloo process group on the CPU."""
import contextlib
import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from helpers.fork import fork_server

JOIN_TIMEOUT = 60  # seconds a spawned group may take before the test fails ("a rank hung")
COLLECTIVE_TIMEOUT = 10  # seconds a collective waits for a peer: a rank left waiting fails instead of hanging


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous of a spawned group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank, port, world):
    """In a spawned child: joins the gloo group of `world` processes on the loopback, one thread per process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))


def run_group(worker, arg, world):
    """Spawns worker(rank, port, arg) on `world` processes and joins them with a timeout; their exit codes (a
    process killed by signal s: -s). A process still alive after the timeout is killed and fails the test."""
    ctx = fork_server()  # torch and swapio imported once by the server: each group starts in ~0.1 s
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, arg)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_TIMEOUT)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, "a rank hung"
    return [p.exitcode for p in procs]


@contextlib.contextmanager
def group_of_one(store):
    """In this process: a gloo group of one rank (a file store at `store`), destroyed after the block."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


INDEX = "swapio-checkpoint.json"  # a sharded checkpoint's index


def numbered_state(k):
    """A small state whose values say which save wrote it."""
    return {"w": torch.full((50, 3), float(k)), "k": k}


@pytest.fixture
def one_rank(tmp_path):
    """A test inside a gloo group of one rank (import it into the test module to use it)."""
    with group_of_one(tmp_path / "store"):
        yield
