"""accelerate's unwrap_model(keep_fp32_wrapper=False) of an offloaded model whose root module is offloaded itself
(it owns weights directly, or is a preload module): accelerate takes off its autocast wrapper by binding the
innermost forward it finds to the model (MethodType), which for such a model is swapio's wrapper. The unwrapped
model then computes what the unwrapped resident model computes, trains with a swapio optimizer as it does, and
keeps training after remove_offload (a TypeError "forward() takes 2 positional arguments but 3 were given" before).
remove_offload of such a model after prepare keeps accelerate's autocast wrapper (it dropped it, silently: the
forward then ran in fp32)."""
import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, disk_offload, remove_offload  # noqa: E402


class RootWeights(torch.nn.Module):
    """A root that owns a weight itself (a bias, a position embedding): the root is one of the offloaded units."""

    def __init__(self):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.randn(4))
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.inner(x) + self.shift


def _linear():
    return torch.nn.Linear(8, 4)


MODELS = {"Linear": _linear, "RootWeights": RootWeights}
OFFLOADS = {
    "disk": lambda net, tmp: disk_offload(net, offload_dir=tmp / "od"),
    "cpu": lambda net, tmp: cpu_offload(net),
    "disk-preload-root": lambda net, tmp: disk_offload(net, offload_dir=tmp / "od",
                                                       preload_module_classes=[type(net).__name__]),
}


def _accelerator():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, mixed_precision="bf16")


def _train(model_name, offload, tmp_path):
    """prepare (bf16 autocast), unwrap without the fp32 wrapper, then forward and two steps of OffloadAdamW."""
    torch.manual_seed(0)
    net = MODELS[model_name]()
    if offload:
        net = OFFLOADS[offload](net, tmp_path)
    accelerator = _accelerator()
    opt = so.OffloadAdamW(net.parameters(), lr=1e-2)
    prepared, opt = accelerator.prepare(net, opt)
    with torch.no_grad():
        autocast_out = prepared(torch.ones(2, 8))
    net = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    g = torch.Generator().manual_seed(1)
    outs = [autocast_out]
    for _ in range(2):
        out = net(torch.randn(4, 8, generator=g))
        outs.append(out.detach())
        accelerator.backward(out.square().mean())
        opt.step()
        opt.zero_grad()
    if offload:
        opt.optimizer.close()
        remove_offload(net)
    with torch.no_grad():
        outs.append(net(torch.ones(2, 8)))
    opt.optimizer.close()
    return outs


@pytest.mark.parametrize("offload", list(OFFLOADS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_unwrap_model_without_fp32_wrapper_computes_as_the_resident_model(model_name, offload, tmp_path):
    want = _train(model_name, None, tmp_path)
    got = _train(model_name, offload, tmp_path)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("offload", list(OFFLOADS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_remove_offload_after_prepare_keeps_autocast(model_name, offload, tmp_path):
    def outputs(offload):
        torch.manual_seed(0)
        net = MODELS[model_name]()
        if offload:
            net = OFFLOADS[offload](net, tmp_path / offload)
        prepared = _accelerator().prepare(net)
        if offload:
            remove_offload(prepared)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            autocast_out = prepared(x)
            unwrapped = Accelerator(cpu=True).unwrap_model(prepared, keep_fp32_wrapper=False)
            return autocast_out, unwrapped(x)
    want = outputs(None)
    assert not torch.equal(want[0], want[1])  # autocast computes in bf16: the first must show it
    for g, w in zip(outputs(offload), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
