"""step() writes the trained weights back from the streamer's own pinned memory (its ring, its spare buffer),
which no module uses while step() runs, instead of pinning a buffer pool of its own beside it: training an
offloaded model pins the weights' budget once. An in_backward update, which runs while backward streams weights,
keeps the pool; the memory lent to a step that failed goes back before the next forward."""
import errno

import pytest
import torch

from swapio.offload.api import _offloaded
from swapio.offload.dir_owner import DATA_PREFIX
from helpers.offload_training import (MLP, batches, build_opt, fail_nth_write, loss_of, make_model, offload,
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
        in_use = ring.in_use
        with one_thread():
            loss_of(model, data[0]).backward()
        opt.step()
        assert ring.in_use <= in_use  # every loan came back with its write


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
