"""int8 optimizer state and non-finite moments: a huge finite gradient overflows g * g, so
exp_avg_sq becomes inf while exp_avg stays finite. int8 cannot store inf; were exp_avg kept beside an exp_avg_sq
stored as 0, the next step would move the parameter by exp_avg / eps (~1e38).

References: the same steps with fp32 state (the native kernel and swapio's optimizer, whose update after the
overflow is 0: exp_avg_sq stays inf) and torch.optim.AdamW. An int8 update must never be worse: the parameter
stays finite wherever fp32 state keeps it finite, within a few lr per step of it. Every SIMD level here is run
(the kernel's `capability`); the optimizers run on the active level (CI also runs this file forced to AVX2).
"""
import warnings

import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
so = pytest.importorskip("swapio.optim")
from swapio import quant  # noqa: E402
from test_optim_state_dtype import kernel_state  # noqa: E402

LEVELS = ops.cpu_capabilities()
N = 3 * 256 + 5
HUGE = {3: 3e38, 300: -3e38, 517: 1e30, N - 1: 2e21}  # all finite; each g * g * (1 - beta2) overflows
LR = 1e-3
ADAM = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
LION = dict(lr=LR, beta1=0.9, beta2=0.99, weight_decay=0.0)
STEPS = 5


def gradients(n=N, steps=STEPS, huge_at=1):
    gen = torch.Generator().manual_seed(7)
    gs = [torch.randn(n, generator=gen) * 1e-2 for _ in range(steps)]
    for i, g in HUGE.items():
        gs[huge_at][i] = g
    return gs


def state(kind, state_dtype, n=N):
    return kernel_state(n, kind, state_dtype)


def step_all(fn, kind, state_dtype, **kw):
    p = torch.randn(N, generator=torch.Generator().manual_seed(8))
    st = state(kind, state_dtype)
    nonfinite = torch.zeros((), dtype=torch.int64)
    for step, g in enumerate(gradients(), 1):
        if kind == "adam":
            fn(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, exp_avg_scale=st.get("exp_avg_scale"),
               exp_avg_sq_scale=st.get("exp_avg_sq_scale"), nonfinite=nonfinite, **ADAM, **kw)
        else:
            fn(p, g, st["exp_avg"], step=step, exp_avg_scale=st.get("exp_avg_scale"), nonfinite=nonfinite,
               **LION, **kw)
    return p, st, int(nonfinite)


def assert_not_worse(p_int8, p_fp32, what):
    """Finite wherever fp32 state is, and within 4 lr per step of it (Adam's update is at most ~3.2 lr)."""
    fin = torch.isfinite(p_fp32)
    assert fin.all(), f"{what}: the fp32 reference itself is not finite"
    assert torch.isfinite(p_int8[fin]).all(), f"{what}: int8 state made a parameter non-finite"
    gap = (p_int8 - p_fp32).abs().max().item()
    assert gap <= 4 * LR * STEPS, f"{what}: int8 state moved a parameter {gap:.3g} away from fp32 state's"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["adam", "lion"])
def test_kernel_int8_huge_gradient_is_no_worse_than_fp32(level, kind):
    fn = ops.adam_step_ if kind == "adam" else ops.lion_step_
    p32, _, _ = step_all(fn, kind, "fp32", capability=level)
    p8, st, count = step_all(fn, kind, "int8", capability=level)
    assert_not_worse(p8, p32, f"{kind} at {level}")
    if kind == "adam":
        assert count == len(HUGE)  # each overflow reported once, on the step it happened
        for name in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
            assert torch.isfinite(st[name].float()).all(), name


@pytest.mark.parametrize("level", LEVELS)
def test_kernel_int8_drops_both_moments_of_an_overflowed_element(level):
    # one step: the elements whose g * g overflowed store the zero code in both moments, the others do not
    p = torch.zeros(N)
    st = state("adam", "int8")
    g = gradients(steps=1, huge_at=0)[0]
    ops.adam_step_(p, g, st["exp_avg"], st["exp_avg_sq"], step=1, exp_avg_scale=st["exp_avg_scale"],
                   exp_avg_sq_scale=st["exp_avg_sq_scale"], capability=level, **ADAM)
    m = quant.dequantize(st["exp_avg"], st["exp_avg_scale"], signed=True)
    v = quant.dequantize(st["exp_avg_sq"], st["exp_avg_sq_scale"], signed=False)
    huge = torch.zeros(N, dtype=torch.bool)
    huge[list(HUGE)] = True
    assert (m[huge] == 0).all() and (v[huge] == 0).all()
    assert (v[~huge] > 0).sum() > N // 2  # the others keep their moments (with the scale of their own values)


@pytest.mark.parametrize("kind", ["adam", "lion"])
def test_reference_int8_huge_gradient_matches_the_kernel(kind):
    # the plain-torch reference pairs the moments the same way (codes bit for bit)
    kernel = ops.adam_step_ if kind == "adam" else ops.lion_step_
    reference = ops.adam_step_reference_ if kind == "adam" else ops.lion_step_reference_
    p_k, st_k, _ = step_all(kernel, kind, "int8")
    p_r, st_r, _ = step_all(reference, kind, "int8")
    for name in st_k:
        assert torch.equal(st_k[name], st_r[name]), name
    torch.testing.assert_close(p_k, p_r, rtol=1e-5, atol=1e-6)


def run_optimizer(cls, state_dtype, torch_cls=None, **hyper):
    p = torch.nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(8)))
    if torch_cls is not None:
        opt = torch_cls([p], **hyper)
    else:
        opt = cls([p], offload="cpu", state_dtype=state_dtype, **hyper)
    for g in gradients():
        p.grad = g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the non-finite moments' warning
            opt.step()
    return p.detach()


@pytest.mark.parametrize("cls,hyper", [(so.OffloadAdamW, dict(lr=LR, weight_decay=0.01)),
                                       (so.OffloadAdam, dict(lr=LR)),
                                       (so.OffloadLion, dict(lr=LR, weight_decay=0.1))],
                         ids=["AdamW", "Adam", "Lion"])
def test_optimizer_int8_huge_gradient_is_no_worse_than_fp32(cls, hyper):
    p32 = run_optimizer(cls, "fp32", **hyper)
    assert_not_worse(run_optimizer(cls, "int8", **hyper), p32, f"{cls.__name__} int8 vs fp32")
    if cls is so.OffloadAdamW:  # and torch's AdamW agrees with fp32 state
        ref = run_optimizer(None, None, torch_cls=torch.optim.AdamW, **hyper)
        torch.testing.assert_close(p32, ref, rtol=1e-5, atol=1e-6)


def continue_after(opt, p, gs):
    for g in gs:
        p.grad = g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return p.detach()


@pytest.mark.parametrize("route", ["state_dict", "checkpoint"])
def test_loading_overflowed_fp32_state_into_int8_is_no_worse(route, tmp_path):
    # fp32 state that went through the overflow (exp_avg_sq inf beside a finite exp_avg), loaded into int8 state:
    # from torch's AdamW state dict, or from an fp32-state optimizer's checkpoint (converted on load)
    gs = gradients()
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(8))
    src = torch.nn.Parameter(p0.clone())
    if route == "state_dict":
        first = torch.optim.AdamW([src], lr=LR, weight_decay=0.0)
    else:
        first = so.OffloadAdamW([src], lr=LR, weight_decay=0.0, offload="cpu", state_dtype="fp32")
    continue_after(first, src, gs[:2])
    ref = continue_after(first, src, gs[2:]).clone()  # fp32 state all the way
    p = torch.nn.Parameter(p0.clone())
    warm = torch.optim.AdamW([p], lr=LR, weight_decay=0.0) if route == "state_dict" else \
        so.OffloadAdamW([p], lr=LR, weight_decay=0.0, offload="cpu", state_dtype="fp32")
    continue_after(warm, p, gs[:2])
    assert torch.isinf(warm.state[p]["exp_avg_sq"]).any()
    loaded = so.OffloadAdamW([p], lr=LR, weight_decay=0.0, offload="cpu", state_dtype="int8")
    if route == "state_dict":
        loaded.load_state_dict(warm.state_dict())
    else:
        warm.save(tmp_path / "ckpt")
        loaded.load(tmp_path / "ckpt")
    assert_not_worse(continue_after(loaded, p, gs[2:]), ref, f"int8 loaded through {route}")
