"""Offloaded weights of dtypes the optimizers do not step (float64, complex) follow the rule of resident ones: a
trainable one is refused at construction, a frozen one is taken and never stepped, and one that gets a gradient
later is refused at step() before anything is stepped. They were trained through an fp32 master instead: a complex
weight lost its imaginary part without a word (its gradient's too)."""
import pytest
import torch

from swapio.offload import cpu_offload
from swapio.optim import OffloadAdamW


class Complex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return (x.to(torch.complex64) @ self.w).abs()


def model(dtype_module):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), dtype_module, torch.nn.Linear(4, 2))


class Float64(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.s = torch.nn.Parameter(torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5)

    def forward(self, x):
        return (x.double() * self.s).float()


@pytest.mark.parametrize("module", [Complex, Float64])
def test_a_trainable_offloaded_weight_of_another_dtype_is_refused_as_a_resident_one(module):
    dtype = torch.complex64 if module is Complex else torch.float64
    with pytest.raises(ValueError, match=rf"cannot optimize a parameter with dtype {dtype}"):
        OffloadAdamW(model(module()).parameters())  # resident: refused
    with pytest.raises(ValueError, match=rf"cannot optimize a parameter with dtype {dtype}"):
        OffloadAdamW(cpu_offload(model(module())).parameters())


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_frozen_offloaded_float64_weight_is_never_stepped_and_refused_once_it_has_a_gradient(in_backward):
    net, twin = cpu_offload(model(Float64().requires_grad_(False))), model(Float64().requires_grad_(False))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    with OffloadAdamW(net.parameters(), lr=1e-2, in_backward=in_backward) as opt, \
            OffloadAdamW(twin.parameters(), lr=1e-2) as ref:
        for _ in range(2):
            loss = net(x).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            theirs = twin(x).square().sum()
            theirs.backward()
            assert torch.equal(loss, theirs)
            ref.step()
            ref.zero_grad()
        assert sorted(opt.state_dict()["state"]) == [0, 1, 3, 4]
        assert all(torch.equal(opt.param_value(p), q) for p, q in zip(net.parameters(), twin.parameters()))
        net[1].s.requires_grad_(True)  # unfrozen: torch would step it; we cannot
        before = [opt.param_value(p).clone() for p in net.parameters()]
        with pytest.raises(ValueError, match=r"parameter 2 of this OffloadAdamW .* taken frozen .*torch.float64"):
            net(x).square().sum().backward()
            opt.step()
        if not in_backward:  # (in_backward: the other modules' updates ran during backward, as they do)
            assert all(torch.equal(opt.param_value(p), b) for p, b in zip(net.parameters(), before))
        assert 2 not in opt.state_dict()["state"]


def test_a_resident_frozen_parameter_with_a_gradient_is_refused_before_offloaded_weights_are_stepped():
    """step() updates the offloaded weights first: the refusal of a resident parameter came after them."""
    net = cpu_offload(model(torch.nn.GELU()))
    extra = torch.nn.Parameter(torch.randn(3, dtype=torch.float64), requires_grad=False)
    with OffloadAdamW([*net.parameters(), extra], lr=0.1) as opt:
        net(torch.randn(2, 4)).sum().backward()
        before = [opt.param_value(p).clone() for p in net.parameters()]
        extra.grad = torch.ones(3, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"parameter 4 of this OffloadAdamW .* taken frozen .*torch.float64"):
            opt.step()
        assert all(torch.equal(opt.param_value(p), b) for p, b in zip(net.parameters(), before))
        assert opt.state_dict()["state"] == {}
        extra.grad = None
        opt.step()  # and it steps on
        assert not all(torch.equal(opt.param_value(p), b) for p, b in zip(net.parameters(), before))


def test_state_for_a_frozen_offloaded_float64_weight_is_refused_at_load():
    """torch's AdamW over the resident model, which stepped the float64 weight while it was trainable: its state
    for it would have been taken, and the weight rewritten from an fp32 master made of it."""
    resident = model(Float64())
    ref = torch.optim.AdamW(resident.parameters(), lr=1e-2)
    resident(torch.randn(3, 4)).square().sum().backward()
    ref.step()
    net = cpu_offload(model(Float64().requires_grad_(False)))
    with OffloadAdamW(net.parameters(), lr=1e-2) as opt:
        before = [opt.param_value(p).clone() for p in net.parameters()]
        with pytest.raises(ValueError, match=r"state for parameter 2, .* cannot step: it has dtype torch.float64"):
            opt.load_state_dict(ref.state_dict())
        assert all(torch.equal(opt.param_value(p), b) for p, b in zip(net.parameters(), before))
        assert opt.state_dict()["state"] == {}
