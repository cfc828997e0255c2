"""The optimizer family's base and its seams: OffloadOptimizer, stepping a subset of parameters with gradients
from elsewhere, backends without the optimizer, the buffer budget, the state format, the functional layer."""
import gc
import os

import pytest
import torch

import swapio
import swapio.optim as so
from swapio.core import _align
from swapio.optim import functional
from swapio.optim.options import BufferBudget
from swapio.optim.state_format import StateFormat
from helpers.optim import SMALL_BUFFERS

MODES = ["cpu", "nvme"]


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_(True) for shape in ((300,), (40, 70), (9,))]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _opt(cls, params, mode, tmp_path, **kw):
    return cls(params, offload=mode, swap_dir=tmp_path if mode == "nvme" else None, **SMALL_BUFFERS, **kw)


def test_every_optimizer_of_the_family_is_an_offload_optimizer_and_lion_is_not_an_adam():
    p = [torch.nn.Parameter(torch.zeros(4))]
    for cls in (so.OffloadAdam, so.OffloadAdamW, so.OffloadLion):
        with cls(p) as opt:
            assert isinstance(opt, so.OffloadOptimizer)
            assert isinstance(opt, torch.optim.Optimizer)
    with so.OffloadLion(p) as opt:
        assert not isinstance(opt, so.OffloadAdam)
    with so.OffloadAdamW(p) as opt:
        assert isinstance(opt, so.OffloadAdam)  # AdamW stays a thin subclass of Adam, as in torch


def test_the_base_class_alone_cannot_be_built():
    with pytest.raises(TypeError, match="base"):
        so.OffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], {"betas": (0.9, 0.999)})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_stepping_parameters_in_pieces_with_outside_gradients_equals_one_step(mode, state_dtype, tmp_path):
    whole, pieces = _params(dtype=torch.bfloat16), _params(dtype=torch.bfloat16)
    a = _opt(so.OffloadAdamW, whole, mode, tmp_path, state_dtype=state_dtype)
    b = _opt(so.OffloadAdamW, pieces, mode, tmp_path, state_dtype=state_dtype)
    for step in range(3):
        grads = _grads(whole, step)
        for p, g in zip(whole, grads):
            p.grad = g
        a.step()
        outside = dict(zip(pieces, grads))  # never in p.grad: as from a buffer beside the state
        b._step_params(pieces[1:], outside.get)  # a later module's gradients complete first
        b._step_params(pieces[:1], outside.get)
        assert all(p.grad is None for p in pieces)
    for p, q in zip(whole, pieces):
        assert torch.equal(p, q)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    a.close()
    b.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_backend_holds_no_reference_to_the_optimizer(mode, tmp_path):
    opt = _opt(so.OffloadAdamW, _params(), mode, tmp_path)
    backend = opt._backend
    assert not any(r is opt for r in gc.get_referents(backend))
    assert backend.state is opt.state
    path = opt.swap_path
    del opt, backend
    if mode == "nvme":
        assert not os.path.exists(path)  # dropped at once: nothing holds the optimizer in a cycle


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_keeps_the_state_dict_object_the_backend_holds(mode, tmp_path):
    params = _params()
    opt = _opt(so.OffloadAdam, params, mode, tmp_path)
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    opt.step()
    state = opt.state
    opt.load_state_dict(opt.state_dict())
    assert opt.state is state and opt._backend.state is state
    opt.step()
    opt.close()


def test_the_slot_size_is_the_budget_share_aligned_down():
    budget = BufferBudget(1_000_000, 3)
    assert budget.slot_bytes == _align.round_down(1_000_000 // 3) and budget.slot_bytes % _align.ALIGN == 0
    with pytest.raises(ValueError, match="64 KiB"):
        BufferBudget(3 * (64 << 10) - 1, 3)
    with pytest.raises(ValueError):
        BufferBudget(1 << 20, 2)


def test_align_is_at_least_4096_and_the_page_size():
    assert _align.ALIGN >= 4096 and _align.ALIGN % 4096 == 0
    assert _align.round_up(1) == _align.ALIGN and _align.round_up(_align.ALIGN) == _align.ALIGN


@pytest.mark.parametrize("name,scales,amsgrad,per_element", [("fp32", False, True, 4.0), ("bf16", False, False, 2.0),
                                                               ("int8", True, False, 1.0 + 4.0 / 256)])
def test_the_state_format_answers_by_name(name, scales, amsgrad, per_element):
    fmt = StateFormat(name)
    assert fmt.has_scales is scales and fmt.counts_nonfinite is scales
    assert fmt.supports_amsgrad is amsgrad and fmt.exports_stored is amsgrad
    assert fmt.bytes_per_element == per_element
    assert fmt == StateFormat(name) and fmt != StateFormat("fp32" if name != "fp32" else "bf16")
    assert fmt.scales_of(("exp_avg",)) == (("exp_avg_scale",) if scales else ())


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_functional_adam_gives_the_same_step_with_the_native_kernel_and_the_reference(state_dtype):
    fmt = StateFormat(state_dtype)
    n = 1000
    g = torch.Generator().manual_seed(3)
    param, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    results = []
    for kernel in ("native", "reference"):
        p = param.clone()
        state = {name: torch.zeros(fmt.count(name, n), dtype=fmt.dtype(name))
                 for name in ("exp_avg", "exp_avg_sq") + fmt.scales_of(("exp_avg", "exp_avg_sq"))}
        for step in (1, 2):
            functional.adam(p, grad, state, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.01, adamw=True, maximize=False, threads=1, kernel=kernel)
        results.append(p)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_functional_picks_the_reference_off_the_cpu_and_refuses_an_unknown_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(swapio.ops, "lion_step_reference_", lambda *a, **k: calls.append("reference"))
    monkeypatch.setattr(swapio.ops, "lion_step_", lambda *a, **k: calls.append("native"))
    t = torch.zeros(4)
    meta = torch.zeros(4, device="meta")
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False)
    functional.lion(t, t, {"exp_avg": t}, **kw)
    functional.lion(meta, meta, {"exp_avg": meta}, **kw)
    assert calls == ["native", "reference"]
    with pytest.raises(ValueError, match="kernel"):
        functional.lion(t, t, {"exp_avg": t}, kernel="fused", **kw)


def test_step_report_reset_must_be_a_bool():
    p = torch.nn.Parameter(torch.ones(8))
    opt = swapio.optim.OffloadAdamW([p])
    with pytest.raises(TypeError, match="reset must be a bool"):
        opt.step_report(reset="x")
    opt.close()
