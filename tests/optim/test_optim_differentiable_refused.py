"""torch's differentiable=True records the optimizer step in autograd (meta-learning takes gradients through the
update). swapio's step runs its fused kernel outside autograd: a state dict of such a torch optimizer loaded into
an offloaded one, or a group switched to it, stepped without those gradients, silently. Both are refused; torch's
default (False, in every torch state dict) loads as before."""
import pytest
import torch

import swapio.optim as so


def torch_state():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt.state_dict()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_differentiable_torch_state_dict_is_refused_and_a_plain_one_loads(tmp_path, offload):
    model, state = torch_state()
    assert state["param_groups"][0]["differentiable"] is False
    with so.OffloadAdamW(model.parameters(), offload=offload, swap_dir=tmp_path) as opt:
        opt.load_state_dict(state)
        loaded = opt.state_dict()
        assert torch.equal(loaded["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
        state["param_groups"][0]["differentiable"] = True
        with pytest.raises(ValueError, match="differentiable=True"):
            opt.load_state_dict(state)
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], loaded["state"][0]["exp_avg"])  # unchanged


@pytest.mark.parametrize("make", [so.OffloadAdamW, so.OffloadLion, so.OffloadAdafactor])
def test_a_group_switched_to_differentiable_is_refused_by_step(make):
    model = torch.nn.Linear(4, 3)
    with make(model.parameters(), lr=1e-2) as opt:
        model(torch.randn(2, 4)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.param_groups[0]["differentiable"] = True
        with pytest.raises(ValueError, match="differentiable=True"):
            opt.step()
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        opt.param_groups[0]["differentiable"] = False
        opt.step()
        assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
