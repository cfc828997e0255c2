"""A parameter whose `.data` is replaced by a tensor of another size after its first step no longer fits its
optimizer state. Every offloaded optimizer, in both modes, refuses the step with a ValueError naming the
parameter before anything changes (nvme mode used to step the part its old record covered, silently, and then
refuse every step as "half-stepped"); put back, the parameter steps on as if nothing happened."""
import pytest
import torch

import swapio.optim as so

OPTIMIZERS = [so.OffloadAdamW, so.OffloadAdam, so.OffloadLion, so.OffloadAdafactor]


def _make(cls, params, offload, tmp_path, state_dtype="fp32"):
    kw = {"state_dtype": state_dtype} if cls is not so.OffloadAdafactor else {}
    return cls(params, lr=1e-2, offload=offload, swap_dir=tmp_path, **kw)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("new_shape", [(5, 6), (3, 6), (4, 6, 2)], ids=["grown", "shrunk", "more-dims"])
def test_a_parameter_of_another_size_is_refused_before_any_change(cls, offload, new_shape, tmp_path):
    torch.manual_seed(0)
    p, other = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(300))
    opt = _make(cls, [p, other], offload, tmp_path)
    p.grad, other.grad = torch.randn(4, 6), torch.randn(300)
    opt.step()
    old, before = p.data, {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    other_before = other.detach().clone()
    p.data, p.grad = torch.randn(new_shape), torch.randn(new_shape)
    value = p.detach().clone()
    with pytest.raises(ValueError, match=r"parameter 0 .*no longer fits its state.*another size"):
        opt.step()
    assert torch.equal(p.detach(), value) and torch.equal(other.detach(), other_before)
    assert float(opt.state[p]["step"]) == 1.0
    p.data, p.grad = old, torch.randn(4, 6)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in before.items())
    opt.step()  # not torn: it steps on
    assert float(opt.state[p]["step"]) == 2.0
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_same_count_other_shape_steps_on_elementwise_like_the_flat_parameter(offload, state_dtype, tmp_path):
    """Adam's state is element by element: a reshaped parameter steps on exactly as its flat self would."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 6 * 256))
    q = torch.nn.Parameter(p.detach().clone())
    a = _make(so.OffloadAdamW, [p], offload, tmp_path / "a", state_dtype)
    b = _make(so.OffloadAdamW, [q], offload, tmp_path / "b", state_dtype)
    g = torch.randn(4, 6 * 256)
    p.grad, q.grad = g.clone(), g.clone()
    a.step(), b.step()
    p.data, p.grad = p.data.reshape(6 * 256, 4).clone(), g.reshape(6 * 256, 4).clone()
    q.grad = g.clone()
    a.step(), b.step()
    assert torch.equal(p.detach().reshape(4, -1), q.detach())
    a.close(), b.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_adafactor_refuses_a_reshaped_matrix_its_factors_no_longer_fit(offload, tmp_path):
    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = _make(so.OffloadAdafactor, [p], offload, tmp_path)
    p.grad = torch.randn(4, 6)
    opt.step()
    p.data, p.grad = torch.randn(6, 4), torch.randn(6, 4)
    value = p.detach().clone()
    with pytest.raises(ValueError, match=r"no longer fits its state.*row_var"):
        opt.step()
    assert torch.equal(p.detach(), value) and float(opt.state[p]["step"]) == 1.0
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("cls", [so.OffloadAdamW, so.OffloadLion], ids=lambda c: c.__name__)
def test_same_count_other_shape_exports_state_shaped_like_the_parameter_and_loads_it_back(cls, state_dtype, offload,
                                                                                          tmp_path):
    """state_dict() gives the moments the parameter's current shape in every mode and state_dtype (cpu mode's
    live fp32 tensors kept the first step's), so that load_state_dict(), which checks shapes, takes it back."""
    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = _make(cls, [p], offload, tmp_path, state_dtype)
    p.grad = torch.randn(4, 6)
    opt.step()
    p.data, p.grad = p.data.reshape(6, 4).clone(), torch.randn(6, 4)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].shape == (6, 4)
    before = {k: v.clone() for k, v in sd["state"][0].items()}
    opt.load_state_dict(sd)
    assert all(torch.equal(opt.state_dict()["state"][0][k], v) for k, v in before.items())
    opt.close()
