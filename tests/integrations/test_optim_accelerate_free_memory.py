"""accelerator.free_memory() (or clear()) between two trainings, then a new swapio optimizer on the same model,
as accelerate's docs have it: `model, opt = accelerator.free_memory(model, opt)`. The second training gives what
a fresh optimizer on the weights the first left gives without accelerate; for an offloaded model too, whose
weights the first optimizer owned until it went. An old optimizer still referenced (free_memory() without
handing it over) keeps its offloaded weights: the new one is a ValueError saying to close() it."""
import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, disk_offload, remove_offload  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _offloaded(kind, tmp_path):
    net = _net()
    if kind == "disk":
        return disk_offload(net, offload_dir=tmp_path / "od")
    return cpu_offload(net) if kind == "cpu" else net


def _train(model, opt, seed, backward=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 4, generator=g))
        (backward or torch.Tensor.backward)(loss)
        opt.step()
        opt.zero_grad()


def _make(mode, tmp_path):
    extra = {"swap_dir": tmp_path / "swap"} if mode == "nvme" else {}
    return lambda params: so.OffloadAdamW(params, lr=1e-2, offload=mode, **extra)


@pytest.mark.parametrize("release", ["free_memory", "clear"])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", [None, "disk", "cpu"])
def test_a_new_optimizer_after_free_memory_trains_as_without_accelerate(kind, mode, release, tmp_path):
    make = _make(mode, tmp_path)
    want_model = _offloaded(kind, tmp_path / "want")
    for seed in (1, 2):
        opt = make(want_model.parameters())
        _train(want_model, opt, seed)
        opt.close()
    with torch.no_grad():
        want = want_model(torch.ones(2, 8))

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    net = _offloaded(kind, tmp_path / "got")
    model, opt = accelerator.prepare(net, make(net.parameters()))
    _train(model, opt, 1, accelerator.backward)
    model, opt = getattr(accelerator, release)(model, opt)
    assert opt is None and accelerator._optimizers == []
    model, opt = accelerator.prepare(net, make(net.parameters()))
    _train(model, opt, 2, accelerator.backward)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.ones(2, 8)), want, rtol=0, atol=0)
    opt.optimizer.close()
    if kind:
        remove_offload(net)
        remove_offload(want_model)


@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_an_old_optimizer_still_referenced_keeps_the_offloaded_weights(kind, tmp_path):
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    net = _offloaded(kind, tmp_path)
    model, opt = accelerator.prepare(net, so.OffloadAdamW(net.parameters(), lr=1e-2))
    accelerator.free_memory()
    with pytest.raises(ValueError, match=r"0\.weight' is already trained by another swapio optimizer.*close\(\)"):
        so.OffloadAdamW(net.parameters(), lr=1e-2)
    opt.optimizer.close()
    new = so.OffloadAdamW(net.parameters(), lr=1e-2)  # once closed, the weights are free
    new.close()
    remove_offload(net)
