"""save(..., distributed=True) killed (SIGKILL) at each point of the save, on one rank (gloo, 2 processes): the
directory then loads, on every rank, as exactly the previous checkpoint (a kill before rank 0 committed the index,
the save's one commit point) or exactly the new one (after it), never an error nor a mix of the two; and the next
complete save leaves nothing of the interrupted one behind. The kill is injected in the child by wrapping one
function the save calls, so that it does its work (or not) and then kills its process. The files the index names
are checked by safetensors' own loader; then a second group loads what is there, saves again and loads that.
Every group is joined with a timeout and its collectives time out in 10 s."""
import json
import os
import signal

import pytest
import safetensors.torch as st
import torch
import torch.distributed as dist

import swapio
from helpers.checkpoint import assert_same
from helpers.distributed import init_group, run_group

pytestmark = [pytest.mark.slow, pytest.mark.crash]

WORLD = 2
INDEX = "swapio-checkpoint.json"
OLD, NEW, NEXT = 1, 2, 3  # the state of the save before the killed one, the killed one's, the one after

# (where the kill lands, the rank killed, which save loads afterwards)
POINTS = [
    ("writing", 1, OLD),          # while writing its file
    ("before_commit", 1, OLD),    # its file written, not yet in its place (the other rank's may be)
    ("committed", 0, OLD),        # its file in its place, the other's perhaps not yet
    ("committed", 1, OLD),
    ("index_written", 0, OLD),    # the new index written, not yet renamed over the old one
    ("index_committed", 0, NEW),  # the new index in place: the commit point is behind
    ("cleaning", 0, NEW),         # removing the files the new index no longer names
    ("cleaning", 1, NEW),
]


def _state(rank, k):
    return {"w": torch.full((300, 3), float(10 * k + rank)), "b": torch.arange(5) + 100 * k + rank, "k": k,
            "rank": rank}


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(point):
    """Makes this process die at `point` of the next save (see POINTS)."""
    from swapio.core import _durable
    from swapio.safetensors.file_writer import FileWriter
    commit, write_and_replace, discard = FileWriter.commit, _durable.write_and_replace, _durable.discard

    def write_only(tmp, final, write, written=None, mode="wb"):
        with open(tmp, mode) as f:
            write(f)
        _kill()

    def then_kill(real):
        def wrapped(*args, **kwargs):
            real(*args, **kwargs)
            _kill()
        return wrapped

    def discard_rank_file(*paths):
        discard(*paths)
        if any(os.path.basename(p).startswith("rank-") for p in paths):
            _kill()

    if point == "writing":
        FileWriter.write = lambda *a, **k: _kill()
    elif point == "before_commit":
        FileWriter.commit = lambda self: _kill()
    elif point == "committed":
        FileWriter.commit = then_kill(commit)
    elif point == "index_written":
        _durable.write_and_replace = write_only
    elif point == "index_committed":
        _durable.write_and_replace = then_kill(write_and_replace)
    elif point == "cleaning":
        _durable.discard = discard_rank_file


def _killed_worker(rank, port, arg):
    path, point, victim = arg
    init_group(rank, port, WORLD)
    swapio.checkpoint.save(_state(rank, OLD), path, distributed=True)
    if rank == victim:
        _inject(point)
    try:
        swapio.checkpoint.save(_state(rank, NEW), path, distributed=True)
    except RuntimeError:
        pass  # the survivor: gloo's error for a peer that died (or it returned: the peer died after the agreement)
    os._exit(0)  # (a process group never destroyed, its peer dead, may abort at interpreter exit)


def _which(path, rank):
    """OLD or NEW: the save whose state `path` loads as on this rank, else what went wrong."""
    try:
        state = swapio.checkpoint.load(path)
    except (ValueError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    for k in (OLD, NEW, NEXT):
        try:
            assert_same(state, _state(rank, k))
            return k
        except AssertionError:
            pass
    return f"neither save: {state}"


def _verify_worker(rank, port, root):
    """Per directory: which save loads, then a complete save over it and which loads after that."""
    init_group(rank, port, WORLD)
    seen = {}
    try:
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            seen[name] = {"loads": _which(path, rank)}
            swapio.checkpoint.save(_state(rank, NEXT), path, distributed=True)
            seen[name]["next"] = _which(path, rank)
    finally:
        with open(os.path.join(os.path.dirname(root), f"seen-{rank}.json"), "w") as f:
            json.dump(seen, f)
        dist.destroy_process_group()


def _name(point, victim):
    return f"{point}-{victim}"


def _committed(path, survivor):
    """({rank: which save its file holds} for the files the index names, read by safetensors' own loader; the
    survivor's files the index does not name)."""
    with open(os.path.join(path, INDEX)) as f:
        index = json.load(f)
    found = {}
    for r, name in enumerate(index["files"]):
        flat = st.load_file(os.path.join(path, name))
        found[r] = next((k for k in (OLD, NEW) if torch.equal(flat["w"], _state(r, k)["w"])
                         and torch.equal(flat["b"], _state(r, k)["b"])), None)
    return found, [n for n in os.listdir(path) if f"rank-{survivor}" in n and n not in index["files"]]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Each point's directory killed there, what its index committed, then the second group's findings and the
    directories' listings after its save."""
    root = tmp_path_factory.mktemp("dist-kill")
    dirs = root / "dirs"
    dirs.mkdir()
    exits, committed = {}, {}
    for point, victim, _ in POINTS:
        path = str(dirs / _name(point, victim))
        exits[_name(point, victim)] = run_group(_killed_worker, (path, point, victim), WORLD)
        committed[_name(point, victim)] = _committed(path, 1 - victim)
    assert run_group(_verify_worker, str(dirs), WORLD) == [0, 0]
    seen = [json.load(open(root / f"seen-{r}.json")) for r in range(WORLD)]
    listings = {}
    for name in os.listdir(dirs):
        with open(dirs / name / INDEX) as f:
            index = json.load(f)
        listings[name] = (sorted(os.listdir(dirs / name)), sorted([INDEX, *index["files"]]))
    return exits, committed, seen, listings


@pytest.mark.parametrize("point, victim, loads", POINTS, ids=[_name(p, v) for p, v, _ in POINTS])
def test_a_rank_killed_at_any_point_leaves_the_previous_or_the_new_checkpoint_whole(killed, point, victim, loads):
    exits, committed, seen, _ = killed
    name = _name(point, victim)
    assert exits[name][victim] == -signal.SIGKILL and exits[name][1 - victim] == 0, exits[name]
    found, survivor_left = committed[name]
    assert found == {r: loads for r in range(WORLD)}  # the files the index names: one save's, whole
    assert survivor_left == []  # the rank that lived removed its file of the save, or (committed) its previous one
    assert [seen[r][name]["loads"] for r in range(WORLD)] == [loads] * WORLD


@pytest.mark.parametrize("point, victim", [(p, v) for p, v, _ in POINTS], ids=[_name(p, v) for p, v, _ in POINTS])
def test_the_next_save_after_a_kill_leaves_only_its_own_files(killed, point, victim):
    _, _, seen, listings = killed
    name = _name(point, victim)
    assert [seen[r][name]["next"] for r in range(WORLD)] == [NEXT] * WORLD
    listed, named = listings[name]
    assert listed == named  # no temporary file, no rank file of an earlier or interrupted save
