"""Activation offload of GPU tensors, run on the CPU against a simulated CUDA layer (helpers/fake_gpu_activations):
copies to the host on one side stream into blocks of the pinned pool, to the device on another, each run only
when something waits for it, as a GPU may run them late. Gradients equal the run without offload; no copy runs on
a pool block handed out again, no block goes back to the pool while the disk still uses it, and every block goes
back once the graph is gone."""
import pytest
import torch

from helpers.activations import assert_same_grads, batch, grads_of, make_stack
from helpers.fake_gpu_activations import FakeGpu, all_back, watched_offload


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(monkeypatch)
    yield fake
    fake.run_all()  # what the GPU had left
    assert not fake.problems, fake.problems


@pytest.mark.parametrize("to", ["cpu", "nvme"])
@pytest.mark.parametrize("prefetch", [0, 4])
@pytest.mark.parametrize("gpu_catches_up", [False, True])
def test_gpu_tensors_come_back_as_saved_through_late_copies(gpu, tmp_path, to, prefetch, gpu_catches_up):
    model, x = make_stack(), batch(t=16)
    want = grads_of(model, x)
    # staging_bytes=0 (to="nvme"): each save waits for the copy and write before it
    act, pool = watched_offload(gpu, to, tmp_path, model=model, prefetch=prefetch,
                                staging_bytes=0 if prefetch else 1 << 20)
    for _ in range(2):
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
        assert copies_back == act.stats()["tensors"] // (_ + 1)  # one copy back per storage saved
        # the backward's stream waits (on the GPU) for each copy back, and each tensor is marked in use by it
        assert sum(1 for _, what in gpu.compute.ops if what == "wait") >= copies_back
        assert sum(1 for _, stream in gpu.recorded if stream == "compute") == copies_back
        if to == "cpu":  # the forward never waits for its copies to the host
            assert not [e for e in forward if e[0] == "host waits"]
        del loss
        assert all_back(pool)
    assert gpu.side_allocations > 0
    act.close()
