"""OffloadAdafactor's state: torch.optim.Adafactor's state dict both ways, streaming checkpoints across offload
modes (resumed runs bit-identical), and the memory goal (the factored moments of a 4096 x 4096 weight take
<= 0.01 bytes a parameter beyond the fp32 master)."""
import copy

import pytest
import torch

so = pytest.importorskip("swapio.optim", reason="swapio is not built (python setup.py build_ext --inplace)")
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: E402,F401

SHAPES = [(37,), (24, 40), (3, 5, 33), (300, 70)]


def make(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def steps(opt, params, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def opt_of(params, offload, tmp_path, **kw):
    return so.OffloadAdafactor(params, offload=offload, swap_dir=tmp_path, weight_decay=0.01, **SMALL_BUFFERS,
                               **kw)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_state_dict_loads_into_torch_adafactor_and_back(offload, tmp_path):
    """Ours -> torch.optim.Adafactor: both go on alike; torch's -> ours: the same state, the same next steps."""
    ours_params = make()
    ours = opt_of(ours_params, offload, tmp_path)
    steps(ours, ours_params, 5, seed=1)
    ref_params = [p.detach().clone().requires_grad_(True) for p in ours_params]
    ref = torch.optim.Adafactor(ref_params, weight_decay=0.01)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))  # cpu mode's are the live tensors, as torch's are
    for p in ref_params:
        assert set(ref.state[p]) == ({"step", "variance"} if p.dim() < 2 else {"step", "row_var", "col_var"})
    steps(ours, ours_params, 5, seed=2)
    steps(ref, ref_params, 5, seed=2)
    for a, b in zip(ours_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    again_params = [p.detach().clone().requires_grad_(True) for p in ref_params]
    again = opt_of(again_params, offload, tmp_path)
    again.load_state_dict(copy.deepcopy(ref.state_dict()))
    for (i, st), (_, mine) in zip(ref.state_dict()["state"].items(), again.state_dict()["state"].items()):
        assert set(st) == set(mine)
        for name in st:
            assert torch.equal(st[name], mine[name]), name
    ours.close()
    again.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modes", [("cpu", "nvme"), ("nvme", "cpu"), ("nvme", "nvme")])
def test_save_load_resumes_bit_identically_across_modes(dtype, modes, tmp_path):
    full_params = make(dtype)
    full = opt_of(full_params, modes[0], tmp_path)
    steps(full, full_params, 4, seed=1)
    full.save(tmp_path / "ckpt")
    resumed_params = [p.detach().clone().requires_grad_(True) for p in full_params]
    steps(full, full_params, 4, seed=2)
    resumed = opt_of(resumed_params, modes[1], tmp_path)
    resumed.load(tmp_path / "ckpt")
    steps(resumed, resumed_params, 4, seed=2)
    for a, b in zip(full_params, resumed_params):
        assert torch.equal(a, b)
    sa, sb = full.state_dict()["state"], resumed.state_dict()["state"]
    for i in sa:
        for name in sa[i]:
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)
    full.close()
    resumed.close()


def test_checkpoint_of_another_optimizer_is_refused_clearly(tmp_path):
    params = make()
    adamw = so.OffloadAdamW(params)
    steps(adamw, params, 1, seed=1)
    adamw.save(tmp_path / "adamw")
    ada = so.OffloadAdafactor(params)
    with pytest.raises(ValueError, match="lacks|eps must be a pair"):  # AdamW's groups or state, named
        ada.load(tmp_path / "adamw")
    with pytest.raises(ValueError, match="lacks|eps must be a pair"):
        ada.load_state_dict(adamw.state_dict())
    steps(ada, params, 1, seed=2)  # left as it was: still usable


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moments_of_a_4096_square_weight_take_under_a_hundredth_byte_per_parameter(offload, dtype, tmp_path):
    w = torch.zeros(4096, 4096, dtype=dtype, requires_grad=True)
    opt = so.OffloadAdafactor([w], offload=offload, swap_dir=tmp_path)
    w.grad = torch.full_like(w, 1e-3)
    opt.step()
    report = opt.memory_report()
    master = 4 if dtype == torch.bfloat16 else 0  # kept exactly where OffloadAdamW keeps one
    assert report["params"] == w.numel()
    assert report["bytes_per_param"] - master <= 0.01, report
    adamw = so.OffloadAdamW([w], offload=offload, swap_dir=tmp_path)
    adamw.step()
    assert adamw.memory_report()["bytes_per_param"] - master >= 8  # Adam's two fp32 moments, for scale
    opt.close()
    adamw.close()
