"""Backward fetches an offloaded weight again and computes with the fetched region itself, not a private copy
(a copy of the largest module, an LM head, was that much heap beyond the ring in every backward). The region
stays out of the ring while autograd holds the unpacked weight, goes back to it when autograd drops it, and
whatever happens to the record meanwhile (rewritten by a step, the model's offload removed) the weight keeps
the bytes it was fetched with."""
import gc
import sys
import types
import weakref

import pytest
import torch

from swapio.offload import disk_offload, remove_offload
from swapio.offload.api import _offloaded
from swapio.offload.layout import round_up
from swapio.offload.fetch import Fetcher
from helpers.ctrl_c import ctrl_c_on_call
from helpers.fd_audit import code_objects, sweep

WIDTH, LAYERS = 64, 4
LAYER = WIDTH * WIDTH * 4


@pytest.fixture
def offloaded(tmp_path):
    """(model, resident weights, streamer, unpacked): a 4-layer MLP offloaded with a ring of two layers, and a
    spy on the streamer's unpack hook: unpacked.inside, for every weight backward unpacks, whether it lay in the
    fetched record's memory, and unpacked.kept, the first such weight (kept alive past backward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    model.requires_grad_(False)
    resident = [layer.weight.detach().clone() for layer in model]
    disk_offload(model, tmp_path / "od", buffer_bytes=2 * LAYER, prefetch=1)
    streamer = _offloaded[model]
    saved, unpacked = streamer.saved, types.SimpleNamespace(inside=[], kept=[])
    unpack = saved.unpack

    def spy(token):
        t = unpack(token)
        if t.shape == (WIDTH, WIDTH):
            unpacked.inside.append(any(streamer.fetcher.is_region(f, t) for f in streamer.fetcher.fetches.values()))
            if not unpacked.kept:
                unpacked.kept.append(t)
        return t
    saved.unpack = spy  # enter() pushes the instance's attribute: the spy
    yield model, resident, streamer, unpacked
    unpacked.kept.clear()
    remove_offload(model)


def forward(model, x):
    for layer in model:
        x = layer(x)
    return x.square().sum()


def want_grad(resident, x):
    x = x.detach().requires_grad_(True)
    h = x
    for w in resident:
        h = h @ w.t()
    return torch.autograd.grad(h.square().sum(), x)[0]


def in_ring(streamer, t):
    start = streamer.fetcher.ring.arena.data_ptr()
    return start <= t.data_ptr() < start + streamer.fetcher.ring.capacity


def test_backward_computes_with_the_fetched_region_and_gives_it_back(offloaded):
    model, resident, streamer, unpacked = offloaded
    x = torch.randn(3, WIDTH, requires_grad=True)
    got = torch.autograd.grad(forward(model, x), x)[0]
    assert torch.equal(got, want_grad(resident, x))
    assert len(unpacked.inside) == LAYERS and all(unpacked.inside)  # the fetched pages, not copies
    assert in_ring(streamer, unpacked.kept[0])
    unpacked.kept.clear()
    gc.collect()
    fetcher = streamer.fetcher
    assert all(f.held == 0 and f.users == 0 for f in fetcher.fetches.values())
    assert fetcher.ring.in_use == sum(round_up(f.record.nbytes) for f in fetcher.fetches.values())  # nothing else kept
    assert fetcher.stats["temp"] == 0


def test_a_held_weight_keeps_its_region_out_of_the_ring(offloaded):
    model, resident, streamer, unpacked = offloaded
    fetcher = streamer.fetcher
    x = torch.randn(3, WIDTH, requires_grad=True)
    torch.autograd.grad(forward(model, x), x)
    kept = unpacked.kept[0]  # the last layer's weight (backward's first), kept past backward by the caller
    kept_bytes = kept.clone()
    record = next(f.record for f in fetcher.fetches.values() if f.held)
    for _ in range(3):  # forwards and backwards stream every layer through the rest of the ring meanwhile
        got = torch.autograd.grad(forward(model, x), x)[0]
        assert torch.equal(got, want_grad(resident, x))
    assert all(unpacked.inside)
    assert torch.equal(kept, kept_bytes)  # its region was never handed out again
    assert fetcher.fetches[record].held == 1
    del kept
    unpacked.kept.clear()
    gc.collect()
    fetcher.drop_unused(keep=())
    assert fetcher.ring.in_use == 0


def test_a_rewritten_record_leaves_a_held_weight_its_old_bytes(offloaded):
    """A step rewrites the record (forget) while backward's weight lives: the weight keeps the bytes it was
    fetched with, the next fetch reads the new ones, and the old region is freed when the weight dies."""
    model, resident, streamer, unpacked = offloaded
    fetcher = streamer.fetcher
    x = torch.randn(3, WIDTH, requires_grad=True)
    torch.autograd.grad(forward(model, x), x)
    kept = unpacked.kept[0]
    old = kept.clone()
    fetch = next(f for f in fetcher.fetches.values() if f.held)
    fetcher.forget(fetch.record)  # was a RuntimeError only for a module running with it
    assert fetch.record not in fetcher.fetches and fetch.detached
    assert fetcher.ring.in_use >= fetch.record.nbytes
    new = fetcher.acquire(fetch.record)  # a fresh region: the held one is not reused
    assert new is not fetch and new.host.data_ptr() != fetch.host.data_ptr()
    fetcher.release(new)
    assert torch.equal(kept, old)
    del kept
    unpacked.kept.clear()
    gc.collect()
    assert fetch.held == 0 and not fetch.detached  # freed by the weight's death
    fetcher.drop_unused(keep=())
    assert fetcher.ring.in_use == 0


def test_remove_offload_while_a_weight_is_held(offloaded, tmp_path):
    """The pinned memory under a held weight outlives remove_offload (no use after free)."""
    model, resident, streamer, unpacked = offloaded
    x = torch.randn(3, WIDTH, requires_grad=True)
    torch.autograd.grad(forward(model, x), x)
    kept = unpacked.kept.pop()
    old = kept.clone()
    remove_offload(model)
    [torch.full((1 << 16,), 7.0) for _ in range(64)]  # allocations that would land on freed memory
    assert torch.equal(kept, old)
    assert torch.equal(model[LAYERS - 1].weight, resident[LAYERS - 1])
    disk_offload(model, tmp_path / "od2", buffer_bytes=2 * LAYER)  # the fixture's remove_offload has one to remove


@pytest.mark.parametrize("how,after", [("raise", False), ("signal", True)], ids=["before_hold", "after_hold"])
def test_ctrl_c_around_hold_leaves_nothing_held(offloaded, monkeypatch, ctrl_c_raises, how, after):
    """A Ctrl-C as backward hands a refetched weight to hold() (raised instead of the call, or right after it
    returned): the acquisition is released all the same, so the ring is not left short of a record for good
    and a step may rewrite the record (forget() took a leaked acquisition for a module running with it)."""
    model, resident, streamer, unpacked = offloaded
    fetcher = streamer.fetcher
    x = torch.randn(3, WIDTH, requires_grad=True)
    ctrl_c_on_call(monkeypatch, Fetcher, "hold", 1, how=how, after=after)
    with pytest.raises(KeyboardInterrupt):
        torch.autograd.grad(forward(model, x), x)
    monkeypatch.undo()
    unpacked.kept.clear()
    gc.collect()
    assert all(f.users == 0 and f.held == 0 for f in fetcher.fetches.values())
    for record in list(fetcher.fetches):
        fetcher.forget(record)  # no module runs: every record may be rewritten
    fetcher.drop_unused(keep=())
    assert fetcher.ring.in_use == 0
    assert torch.equal(torch.autograd.grad(forward(model, x), x)[0], want_grad(resident, x))


class ExpLinear(torch.nn.Linear):
    """Its exp saves its own output, inside the offloaded module (where swapio's hooks for the weights are on)."""

    def forward(self, x):
        return super().forward(x).exp()


def output_freed_at_once(model):
    """A forward dropped without backward, the garbage collector off: whether its output is gone at once."""
    x = torch.randn(4, 8, requires_grad=True)
    gc.disable()
    try:
        y = model(x)
        out = weakref.ref(y)
        del y
        return out() is None
    finally:
        gc.enable()


def test_a_saved_output_does_not_keep_its_graph_alive(tmp_path):
    """A saved output the hooks left in place held its own node (output -> grad_fn -> saved -> output): the graph
    stayed, past the garbage collector too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(ExpLinear(8, 16), ExpLinear(16, 4))
    assert output_freed_at_once(model)  # the reference: resident
    disk_offload(model, tmp_path / "od")
    assert output_freed_at_once(model)
    remove_offload(model)


def test_ctrl_c_as_a_held_weight_dies_still_gives_its_region_back(offloaded, monkeypatch):
    """BUG: the release of a held weight's region ran as a Python finalizer of the weight's memory. A Ctrl-C landing
    as it began (any point before the claim was queued) was dropped by Python, as every exception in a finalizer
    is, and the release with it: the region stayed out of the ring for good. The weight's death now queues the
    claim without running any Python code, and the fetcher's next call releases it."""
    model, resident, streamer, unpacked = offloaded
    fetcher = streamer.fetcher
    x = torch.randn(3, WIDTH, requires_grad=True)
    monkeypatch.setattr(sys, "unraisablehook", lambda args: None)  # the dropped Ctrl-C, as Python drops it
    # what runs when the weight dies: the finalizer's call and the release it makes (none, once queued in C)
    finalizers = {weakref.finalize.__call__.__code__} | {c for c in code_objects(Fetcher) if "died" in c.co_name}

    def backward():
        torch.autograd.grad(forward(model, x), x)
        unpacked.kept.clear()
        gc.collect()

    sweep(backward, finalizers)
    fetcher.drop_unused(keep=())
    assert all(f.users == 0 and f.held == 0 for f in fetcher.fetches.values())
    assert fetcher.ring.in_use == 0
    assert torch.equal(torch.autograd.grad(forward(model, x), x)[0], want_grad(resident, x))
