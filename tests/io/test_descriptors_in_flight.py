"""Checkpoints written and read by one request per tensor keep a bounded number in flight (core/_in_flight.py):
each holds its file open until it finishes, and all at once needed hundreds of descriptors (thousands on a slow
disk), EMFILE in a process with few left (`ulimit -n 1024` and a DataLoader's, NCCL's own). Here each runs with
100 left (the saves failed every time without the bound, the loads at times: reads pile up less)."""
import os
import resource

import pytest
import torch

import swapio

SPARE = 100


@pytest.fixture
def few_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + SPARE, hard))
    yield limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_optimizer_save_and_load_of_thousands_of_parameters(tmp_path, few_descriptors, offload):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(800)]
    opt = swapio.optim.OffloadAdamW(params, offload=offload, swap_dir=tmp_path / "swap")
    for p in params:
        p.grad = torch.randn(16)
    opt.step()
    before = opt.state_dict()["state"]
    few_descriptors()
    opt.save(tmp_path / "ckpt")
    opt.zero_grad()
    opt.step()  # (zero gradients: the moments decay, so the load below has something to undo)
    opt.load(tmp_path / "ckpt")
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, state in before.items() for k, v in state.items())
    opt.close()


def test_checkpoint_of_many_big_tensors(tmp_path, few_descriptors):
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(96)}  # 1 MiB each: written from itself
    few_descriptors()
    swapio.checkpoint.save(state, tmp_path / "c.safetensors")
    loaded = swapio.checkpoint.load(tmp_path / "c.safetensors")
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def _deep_model(depth):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(depth)])


@pytest.mark.parametrize("offload", ["cpu", "nvme"])  # (nvme: the gradient sums' file too)
def test_offloaded_training_step_of_hundreds_of_modules(tmp_path, few_descriptors, offload):
    model, reference = _deep_model(300), _deep_model(300)
    swapio.offload.disk_offload(model, tmp_path / "weights", execution_device="cpu")
    x = torch.randn(4, 32)
    with swapio.optim.OffloadAdamW(model.parameters(), offload=offload, swap_dir=tmp_path / "swap") as opt:
        few_descriptors()
        model(x).sum().backward()
        opt.step()  # writes every module's weights back
    torch_opt = torch.optim.AdamW(reference.parameters())
    reference(x).sum().backward()
    torch_opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


def test_activation_offload_of_hundreds_of_tensors(tmp_path, few_descriptors):
    model, reference = _deep_model(600), _deep_model(600)
    x = torch.randn(4, 32)
    few_descriptors()
    offload = swapio.offload.offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0)
    with offload:
        loss = model(x).sum()
    loss.backward()
    offload.close()
    reference(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
