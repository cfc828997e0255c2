"""Read-ahead remembers what it started (read_ahead.py): a module's forward extends it by about one unit, where
every module walked WALK_UNITS units ahead again (a model of many small modules: 0.35 ms a module under
cpu_offload, resident 10 us), and it starts the same fetches a walk from scratch starts, however modules run."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, fetch, remove_offload
from swapio.offload.api import _offloaded
from swapio.offload.read_ahead import SMALL, WALK_UNITS
from swapio.offload.schedule import Schedule
from swapio.offload.streamer import WeightStreamer
from helpers.offload import one_thread


def offload(model, kind, tmp_path, **kw):
    return cpu_offload(model, **kw) if kind == "cpu" else disk_offload(model, tmp_path / "od", **kw)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_forward_walks_about_one_unit_a_module(tmp_path, monkeypatch, kind):
    walked = {}
    for n in (100, 200):
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])  # each under SMALL: none counts
        x = torch.randn(2, 8)
        with torch.no_grad():
            want = model(x)
        count, real = [0], Schedule.ahead

        def counted(self, *args, **kwargs):
            for unit in real(self, *args, **kwargs):
                count[0] += 1
                yield unit
        with monkeypatch.context() as patch, torch.no_grad(), one_thread():
            patch.setattr(Schedule, "ahead", counted)
            offload(model, kind, tmp_path / str(n))
            for _ in range(2):  # the first forward learns the order, the second that the next starts over
                assert torch.equal(model(x), want)
            count[0] = 0
            assert torch.equal(model(x), want)
            assert torch.equal(model(x), want)
        walked[n] = count[0] / 2
        remove_offload(model)
        assert torch.equal(model(x), want)
    # one unit a module in the steady state (was WALK_UNITS = 64 a module); twice the modules, twice the walk
    assert walked[100] <= 100 + 2 and walked[200] <= 200 + 2, walked
    assert walked[200] - walked[100] <= 100 + 2, walked


def from_scratch(self, walk, unit):
    """Read-ahead as it was, walking from `unit` at every module: the reference for what the frontier starts."""
    if not self.prefetch:
        return
    counted, by_bytes = 0, self.fetcher.ring is not None
    wanted = set(unit.records)
    for visited, other in enumerate(walk(unit)):
        near = counted < self.prefetch
        if not (near or by_bytes) or visited >= max(WALK_UNITS, self.prefetch):
            return
        for record in other.records:
            wanted.add(record)
            fetch = self.fetcher.start(record, copy=near)
            if fetch is None and self.fetcher.drop_unused(keep=wanted):
                fetch = self.fetcher.start(record, copy=near)
            if fetch is None:
                return
        counted += sum(r.nbytes for r in other.records) >= SMALL


class Mixed(torch.nn.Module):
    """Small and large (over SMALL) modules, run in order, interleaved, with some skipped, or some twice."""

    def __init__(self):
        super().__init__()
        big = SMALL // 4 // 16 + 8  # a Linear(16, big) and back: over SMALL together
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(16, 16) if i % 3 else torch.nn.Sequential(torch.nn.Linear(16, big),
                                                                       torch.nn.Linear(big, 16))
            for i in range(30))
        self.order = list(range(30))

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


ORDERS = [list(range(30)), list(range(0, 30, 2)) + list(range(1, 30, 2)), [i for i in range(30) if i % 4],
          list(range(6)) * 2 + list(range(6, 30)), list(range(30))]


@pytest.mark.slow
@pytest.mark.parametrize("kind,prefetch,buffer_mib", [("cpu", 1, 0), ("cpu", 2, 0), ("disk", 1, 2), ("disk", 2, 9)])
def test_the_frontier_starts_what_a_walk_from_scratch_starts(tmp_path, monkeypatch, kind, prefetch, buffer_mib):
    x = torch.randn(3, 16)
    runs = []
    for impl in (from_scratch, WeightStreamer._prefetch):
        torch.manual_seed(0)
        model = Mixed().requires_grad_(False)
        wants = []
        for order in ORDERS:
            model.order = order
            with torch.no_grad():
                wants.append(model(x))
        extra = {"buffer_bytes": buffer_mib << 20} if kind == "disk" else {}
        offload(model, kind, tmp_path / impl.__name__, prefetch=prefetch, **extra)
        fetcher, seen = _offloaded[model].fetcher, []

        def traced(self, walk, unit, impl=impl):
            impl(self, walk, unit)
            seen.append((walk.__name__, unit.name, [(r.index, f.copy) for r, f in fetcher.fetches.items()],
                         fetcher.ring.in_use if fetcher.ring is not None else 0))
        with monkeypatch.context() as patch:
            patch.setattr(WeightStreamer, "_prefetch", traced)
            for order, want in zip(ORDERS, wants):
                model.order = order
                with one_thread():
                    ids = x.clone().requires_grad_(True)  # backward fetches the weights again, reading behind
                    out = model(ids)
                    out.square().sum().backward()
                assert torch.equal(out.detach(), want)
        runs.append(seen)
        remove_offload(model)
    # forward reads ahead; backward, fetching the disk's weights again, reads behind
    assert {walk for walk, *_ in runs[0]} == ({"ahead", "behind"} if kind == "disk" else {"ahead"})
    assert runs[1] == runs[0]


def test_a_frontier_not_called_for_long_keeps_a_bounded_log(tmp_path, monkeypatch):
    # the backward's frontier hears of every fetch the forwards release: during inference nobody reads its log
    monkeypatch.setattr(fetch, "REMOVALS_KEPT", 8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)]).requires_grad_(False)
    x = torch.randn(2, 8, requires_grad=True)
    want = model(x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    disk_offload(model, tmp_path / "od")
    with one_thread():
        for _ in range(2):
            (grad,) = torch.autograd.grad(model(x).sum(), x)  # backward reads behind
            assert torch.equal(grad, want_grad)
        behind = _offloaded[model].read_ahead[Schedule.behind]
        with torch.no_grad():
            for _ in range(5):
                assert torch.equal(model(x), want)
        assert behind.removed[-1] is None and len(behind.removed) == 9
        (grad,) = torch.autograd.grad(model(x).sum(), x)  # it starts over
        assert torch.equal(grad, want_grad)
    remove_offload(model)
