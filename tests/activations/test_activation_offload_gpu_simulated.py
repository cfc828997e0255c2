"""Activation offload of GPU tensors, run on the CPU against a simulated CUDA layer (helpers/fake_gpu_activations):
copies to the host on one side stream into blocks of the pinned pool, to the device on another, each run only
when something waits for it, as a GPU may run them late. Gradients equal the run without offload; no copy runs on
a pool block handed out again, no block goes back to the pool while the disk still uses it, and every block goes
back once the graph is gone."""
import pytest
import torch

from helpers.activations import assert_same_grads, batch, grads_of, make_stack
from helpers.fake_gpu_activations import all_back, gpu, watched_offload  # noqa: F401 (gpu: a fixture)


@pytest.mark.parametrize("to", ["cpu", "nvme"])
@pytest.mark.parametrize("prefetch", [0, 4])
@pytest.mark.parametrize("gpu_catches_up", [False, True])
def test_gpu_tensors_come_back_as_saved_through_late_copies(gpu, tmp_path, to, prefetch, gpu_catches_up):
    model, x = make_stack(), batch(t=16)
    want = grads_of(model, x)
    # staging_bytes=0 (to="nvme"): each save waits for the copy and write before it
    act, pool = watched_offload(gpu, to, tmp_path, model=model, prefetch=prefetch,
                                staging_bytes=0 if prefetch else 1 << 20)
    for step in range(2):
        del gpu.trace[:]
        gpu.recorded.clear()
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        torch.manual_seed(123)
        with act:
            loss = model(xx).square().mean()
        forward = list(gpu.trace)
        if gpu_catches_up:
            gpu.run_all()
        loss.backward()
        got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, xx.grad.clone())
        assert_same_grads(got, want)
        copies_back = sum(1 for e in gpu.trace if e == ("queued", "h2d", "to device"))
        assert copies_back == act.stats()["tensors"] // (step + 1)  # one copy back per storage saved
        # the backward's stream waits (on the GPU) for each copy back, and each tensor is marked in use by it
        assert sum(1 for _, what in gpu.compute.ops if what == "wait") >= copies_back
        assert sum(1 for _, stream in gpu.recorded if stream == "compute") == copies_back
        if to == "cpu":  # the forward never waits for its copies to the host
            assert not [e for e in forward if e[0] == "host waits"]
        del loss
        assert all_back(pool)
    assert gpu.side_allocations > 0
    act.close()


@pytest.mark.parametrize("to", ["cpu", "nvme"])
def test_a_tensor_dropped_while_its_copy_to_the_host_runs_gives_its_block_back_once_copied(gpu, tmp_path, to):
    # A graph let go inside the forward (a branch whose result is discarded) drops its saved tensors while their
    # copies to the host are still queued: once a copy is seen finished, its pinned block goes back to the pool.
    # to="cpu" kept it until the session's last saved tensor went (after the backward), to="nvme" wrote it out
    # first, for nothing.
    act, pool = watched_offload(gpu, to, tmp_path)
    writes = []
    if to == "nvme":
        real = act._res.handle.pwrite
        act._res.handle.pwrite = lambda *a, **k: (writes.append(1), real(*a, **k))[1]
    w = torch.randn(256, 256, requires_grad=True)
    with act:
        kept = (w * 1).sin()  # saves w * 1
        gone = (w * 2).sin()
        del gone
        gpu.run_all()
        also_kept = (w * 3).sin()  # its save sees the copies before it finished
        if to == "cpu":
            assert pool.in_use == 2 * pool.size(256 * 256 * 4)  # the last one's copy still runs
    gpu.run_all()
    if to == "nvme":
        act._res.handle.wait()
    with act._res.lock:
        next(iter(act._res.sessions)).poll()
    assert len(writes) == (2 if to == "nvme" else 0)
    (kept.sum() + also_kept.sum()).backward()
    assert torch.allclose(w.grad, torch.cos(w) + 3 * torch.cos(3 * w), rtol=0, atol=1e-6)
    del kept, also_kept
    assert all_back(pool)
    act.close()


@pytest.mark.parametrize("to", ["cpu", "nvme"])
@pytest.mark.parametrize("gpu_catches_up", [False, True])
def test_a_change_in_place_after_the_save_is_refused_as_autograd_refuses_it(gpu, tmp_path, to, gpu_catches_up):
    # The copy to the host may run after the change (a late GPU): what it copied may be the changed bytes. The
    # backward refuses the saved tensor, as autograd does without offload, whenever the copy ran.
    act, pool = watched_offload(gpu, to, tmp_path)
    w = torch.randn(256, 256, requires_grad=True)
    with act:
        y = w * 1
        z = y.sin()  # saves y
        if gpu_catches_up:
            gpu.run_all()
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|changed in place"):
        z.sum().backward()
    del z
    assert all_back(pool)
    act.close()


def test_reading_ahead_queues_the_copies_to_the_device_ahead_of_the_unpacks(gpu, tmp_path):
    # Each unpack starts "the reads (and host-to-device copies)" of the next `prefetch` saved tensors: the copy of
    # one read ahead is queued before its unpack, which then finds it running or done. Every copy was queued only
    # by its own unpack, which then held the host until it finished (and to="cpu" had nothing read ahead at all).
    model, x = make_stack(), batch(t=16)
    act, pool = watched_offload(gpu, "cpu", tmp_path, model=model, prefetch=2)
    xx = x.clone().requires_grad_(True)
    with act:
        loss = model(xx).square().mean()
    gpu.run_all()
    del gpu.trace[:]
    loss.backward()
    waits = [e for e in gpu.trace if e[:3] == ("host waits", "h2d", "to device")]
    copies = sum(1 for e in gpu.trace if e == ("queued", "h2d", "to device"))
    assert copies == act.stats()["tensors"]
    # the host waits (if at all: a copy run already does not hold it) with the copies below queued after the one
    # it waits for, but for the last unpacks
    assert waits and all(later >= 1 for *_, later in waits[:-2]), [e[3] for e in waits]
    del loss
    assert all_back(pool)
    act.close()
