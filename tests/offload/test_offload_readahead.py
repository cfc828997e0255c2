"""What disk_offload reads and when: a tied weight is read once (it waits in the spare buffer between its users),
and reads run ahead by bytes, as far as the ring holds and never further."""
import pytest
import torch

import swapio
from swapio.offload import cpu_offload, disk_offload, remove_offload, stats
from swapio.offload.api import _offloaded
from swapio.offload.fetch import Fetcher
from helpers.offload import assert_same_outputs, meta_model, one_thread, reference, resident_model


class CountingHandle(swapio.AioHandle):
    """An AioHandle that records the (path, offset) of every read."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def pread(self, tensor, path, offset=0, **kw):
        self.reads.append((str(path), offset))
        return super().pread(tensor, path, offset, **kw)


def reads_of(handle, record):
    return sum(handle.reads.count((path, offset)) for path, offset, _, _ in record.spans)


def test_tied_weight_is_read_once_across_forwards(tmp_path):
    resident_model().save_pretrained(tmp_path / "ck")
    model = meta_model()
    with CountingHandle() as handle:
        disk_offload(model, checkpoint=tmp_path / "ck", handle=handle)
        engine = _offloaded[model]
        tied = next(r for r in engine.records if len(r.units) > 1)
        assert {s.name for s in tied.slots} == {"transformer.wte.weight"}
        ids = reference()[0]
        with torch.no_grad(), one_thread():
            model(ids)  # the embedding reads it, lm_head finds it in the spare
            assert reads_of(handle, tied) == 1
            model(ids)
            model(ids)
        assert reads_of(handle, tied) == 1  # lm_head, then the next forward's embedding: still in the spare
        assert all(reads_of(handle, r) >= 3 for r in engine.records if r is not tied)  # the others stream
        assert_same_outputs(model)
        remove_offload(model)


class TiedWithBigMiddle(torch.nn.Module):
    """An embedding tied to the head, with a layer larger than the ring between them: that layer needs the spare
    buffer, so the tied weight is evicted from it and read again."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.big = torch.nn.Linear(32, 32 * 64)
        self.proj = torch.nn.Linear(32 * 64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.proj(torch.relu(self.big(self.emb(ids)))))


def test_a_record_larger_than_the_ring_evicts_the_tied_weight(tmp_path):
    torch.manual_seed(0)
    model = TiedWithBigMiddle()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        want = model(ids)
    with CountingHandle() as handle:
        disk_offload(model, tmp_path / "od", buffer_bytes=128 << 10, handle=handle)  # big/proj: 264 KiB each
        tied = next(r for r in _offloaded[model].records if len(r.units) > 1)
        with torch.no_grad():
            for forward in range(1, 3):
                assert torch.equal(model(ids), want)
                assert reads_of(handle, tied) == 2 * forward  # evicted by big and proj, read at emb and head
        assert stats(model)["temp"] == 0
        remove_offload(model)
    assert model.head.weight is model.emb.weight and torch.equal(model(ids), want)


WIDTH = 512
LAYER = WIDTH * WIDTH * 4  # one Linear(512, 512, bias=False) in fp32: 1 MiB, large enough to count for prefetch


def observe_in_forward(layer, fn):
    """Calls fn() inside layer's forward, once swapio put its weights in place (set before offloading)."""
    own = type(layer).forward
    layer.forward = lambda *args, **kwargs: (fn(), own(layer, *args, **kwargs))[1]


def test_reads_run_ahead_as_far_as_the_ring_holds(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(12)])
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        want = model(x)
    seen = []

    def look():  # the module's own fetch and the read-ahead started
        seen.append((sorted(f.record.index for f in fetcher.fetches.values()), fetcher.ring.in_use))
    for layer in model:
        observe_in_forward(layer, look)
    disk_offload(model, tmp_path / "od", buffer_bytes=5 * LAYER, prefetch=1)
    fetcher = _offloaded[model].fetcher
    with torch.no_grad():
        assert torch.equal(model(x), want)
    # one layer running and four read ahead, though prefetch=1: the ring's 5 layers, never more
    assert seen[0] == ([0, 1, 2, 3, 4], 5 * LAYER)
    assert seen[6] == ([6, 7, 8, 9, 10], 5 * LAYER)
    assert seen[11][0] == [0, 1, 2, 3, 11]  # the last layer: the next forward's first ones are on their way
    assert all(in_use <= 5 * LAYER for _, in_use in seen) and stats(model)["temp"] == 0


def test_prefetch_zero_reads_nothing_ahead(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(4)])
    seen = []
    for layer in model:
        observe_in_forward(layer, lambda: seen.append(len(fetcher.fetches)))
    disk_offload(model, tmp_path / "od", buffer_bytes=4 * LAYER, prefetch=0)
    fetcher = _offloaded[model].fetcher
    with torch.no_grad():
        model(torch.randn(1, 64))
    assert seen == [1, 1, 1, 1]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_read_ahead_keeps_outputs_exact_in_generate(tmp_path, prefetch):
    resident_model().save_pretrained(tmp_path / "ck")
    model = disk_offload(meta_model(), checkpoint=tmp_path / "ck", buffer_bytes=96 << 10, prefetch=prefetch)
    assert_same_outputs(model)
    assert stats(model)["temp"] == 0


def test_backward_reads_ahead_through_what_the_forward_read_ahead(tmp_path):
    """At the end of a forward the ring fills with the next forward's first layers; backward needs the last
    ones first, so it drops those reads instead of running without read-ahead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(8)]).requires_grad_(False)
    x = torch.randn(2, WIDTH, requires_grad=True)

    def run(observe=None):
        h = x
        for i, layer in enumerate(model):
            h = layer(h)
            if observe is not None and i < len(model) - 1:
                h.register_hook(observe(i))  # runs once layer i + 1's backward ran, before layer i's
        (grad,) = torch.autograd.grad(h.square().sum(), x)
        return grad
    want = run()
    disk_offload(model, tmp_path / "od", buffer_bytes=4 * LAYER, prefetch=1)
    fetcher, seen = _offloaded[model].fetcher, {}

    def observe(i):
        def hook(grad):
            seen[i] = sorted(f.record.index for f in fetcher.fetches.values())
        return hook
    assert torch.equal(run(observe), want)
    assert seen[6] == [4, 5, 6]  # not the next forward's layers 0-2, read ahead at the end of the forward
    assert all(i in started for i, started in seen.items())  # every layer's read started before it was needed
    assert stats(model)["temp"] == 0


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_forward_walks_ahead_a_bounded_number_of_modules(tmp_path, monkeypatch, offload):
    # a model of small modules (under the size that counts towards prefetch, all in the ring) was walked to its end
    # at every module: a forward quadratic in the module count (800 small Linears: 0.8 ms a module)
    n = 300
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    cpu_offload(model) if offload == "cpu" else disk_offload(model, tmp_path / "od")
    with torch.no_grad():
        model(x)  # (the first forward learns the order)
        starts, real = [0], Fetcher.start

        def counted(self, *args, **kwargs):
            starts[0] += 1
            return real(self, *args, **kwargs)
        monkeypatch.setattr(Fetcher, "start", counted)
        assert torch.equal(model(x), want)
    per_module = starts[0] / n
    assert per_module <= 2 * (64 + 2), per_module  # two records a Linear, WALK_UNITS ahead (was about n)
