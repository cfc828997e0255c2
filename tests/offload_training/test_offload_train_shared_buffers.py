"""step() writes the trained weights back from the streamer's own pinned memory (its ring, its spare buffer),
which no module uses while step() runs, instead of pinning a buffer pool of its own beside it: training an
offloaded model pins the weights' budget once. An in_backward update, which runs while backward streams weights,
keeps the pool; the memory lent to a step that failed goes back before the next forward."""
import errno

import pytest
import torch

from swapio.core.handle import AioHandle
from swapio.offload.api import _offloaded
from swapio.offload.layout import round_up
from swapio.offload.fetch import LENT
from swapio.offload.fetch import Fetcher
from swapio.offload.dir_owner import DATA_PREFIX
from helpers.ctrl_c import ctrl_c_on_call
from helpers.offload_training import (MLP, Tied, batches, build_opt, fail_nth_write, loss_of, make_model, offload,
                                      one_thread, reference, train)


def run(tmp_path, **kw):
    model = offload(make_model(), "disk", tmp_path)
    return model, build_opt("AdamW", model.parameters(), str(tmp_path / "s"), offload="nvme", **kw)


@pytest.mark.parametrize("in_backward", [False, True])
def test_step_writes_weights_from_the_streamers_memory(tmp_path, in_backward):
    data = batches(MLP, 3)
    want_losses, want = reference(str(tmp_path / "ref"), data, offload="nvme")
    model, opt = run(tmp_path, in_backward=in_backward)
    ring = _offloaded[model].fetcher.ring
    with opt:
        losses = train(model, opt, data)
        assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
        for n, p in model.named_parameters():
            assert torch.equal(opt.param_value(p), want[n]), n
        pool = opt.memory_report()["pinned_parts"]["weight_pool"]["bytes"]
        if in_backward:
            assert pool > 0  # updates during backward, while the ring streams: a pool of their own
        else:
            assert pool == 0  # every record written from the ring
        with one_thread():
            loss_of(model, data[0]).backward()
        opt.step()
        # every loan came back with its write: what the ring holds now is fetches (read ahead), nothing else
        fetcher = _offloaded[model].fetcher
        assert ring.in_use == sum(round_up(f.record.nbytes) for f in fetcher.fetches.values() if f.alloc[0] == "ring")
        assert fetcher._spare_user is not LENT


@pytest.mark.parametrize("where", ["state.swap", DATA_PREFIX])
def test_memory_lent_to_a_failed_step_comes_back(tmp_path, monkeypatch, where):
    """A state write failing after some records were written (the step stops before its flush), or every
    weight write failing."""
    data = batches(MLP, 3)
    model, opt = run(tmp_path)
    fetcher = _offloaded[model].fetcher
    with opt:
        train(model, opt, data[:1])
        with one_thread():
            loss_of(model, data[1]).backward()
        fetcher.drop_unused(keep=())
        assert fetcher.ring.in_use == 0
        restore = fail_nth_write(monkeypatch, where, 2, "future", None)
        with pytest.raises(OSError) as info:
            opt.step()
        restore()
        assert info.value.errno == errno.ENOSPC
        assert fetcher.ring.in_use == 0 and fetcher._spare_user is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("owner,name,after", [(Fetcher, "lend", True), (Fetcher, "take_back", False),
                                              (AioHandle, "pwrite", True)], ids=["lend", "take_back", "pwrite"])
@pytest.mark.parametrize("at", [0, 1])
def test_ctrl_c_in_a_step_leaves_no_memory_lent(tmp_path, monkeypatch, ctrl_c_raises, owner, name, after, at):
    """A Ctrl-C right as step() borrows the streamer's memory, gives it back, or writes from it: the memory
    comes back all the same (a loan lost between lend() and its record stayed out of the ring for good), every
    record's turn ends, and training goes on."""
    data = batches(Tied, 4)
    model = offload(make_model(Tied), "disk", tmp_path, Tied, buffer_bytes=1 << 20)
    fetcher = _offloaded[model].fetcher
    with build_opt("AdamW", model.parameters(), str(tmp_path / "s"), offload="nvme") as opt:
        train(model, opt, data[:1])
        with one_thread():
            loss_of(model, data[1]).backward()
        calls = ctrl_c_on_call(monkeypatch, owner, name, at, after=after)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert calls["n"] > at
        monkeypatch.undo()
        fetcher.drop_unused(keep=())
        assert fetcher.ring.in_use == 0 and fetcher._spare_user in (None, *fetcher.fetches)
        opt.zero_grad()
        train(model, opt, data[2:])  # every turn was ended: no step waits for one
        fetcher.drop_unused(keep=())
        assert fetcher.ring.in_use == 0
