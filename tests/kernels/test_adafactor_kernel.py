"""swapio.ops.adafactor_step_ (the native Adafactor step) against torch.optim.Adafactor and its plain-torch
reference; bit-identical at every SIMD level and thread count; bad input raises ValueError."""
import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
from swapio.kernels.adafactor_ops import factored_dims  # noqa: E402

# 1-D, 0-D, 2-D with tails of every length below 16 and several row blocks of 64, >= 3-D
SHAPES = [(7,), (), (5000,), (33, 45), (130, 17), (1, 300), (300, 1), (3, 17, 40), (2, 3, 4, 21)]


def state_for(shape):
    dims = factored_dims(shape)
    if dims is None:
        return {"variance": torch.zeros(max(1, torch.Size(shape).numel()))}
    b, r, c = dims
    return {"row_var": torch.zeros(b * r), "col_var": torch.zeros(b * c)}


def run_native(p0, shape, grads, hyper, **kw):
    p, st = p0.clone().reshape(-1), state_for(shape)
    for step, g in enumerate(grads, 1):
        ops.adafactor_step_(p, g.reshape(-1), shape=shape, step=step, **st, **hyper, **kw)
    return p, st


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hyper", [{}, dict(weight_decay=0.1, maximize=True, lr=0.05),
                                   dict(eps1=1e-3, eps2=1e-2, d=1.5, beta2_decay=-0.5)])
def test_hundred_steps_match_torch_adafactor(shape, hyper):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(100)]
    ref = p0.clone().requires_grad_(True)
    torch_hyper = {k: v for k, v in hyper.items() if k not in ("eps1", "eps2")}
    if "eps1" in hyper:
        torch_hyper["eps"] = (hyper["eps1"], hyper["eps2"])
    opt = torch.optim.Adafactor([ref], **torch_hyper)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    p, st = run_native(p0, shape, grads, hyper)
    torch.testing.assert_close(p.view(shape), ref.detach(), rtol=1e-5, atol=1e-6)
    for name, t in st.items():
        torch.testing.assert_close(t, opt.state[ref][name].reshape(-1)[:t.numel()], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("shape", [(33, 45), (3, 17, 40), (5000,)])
def test_matches_its_plain_torch_reference(shape):
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(20)]
    p, _ = run_native(p0, shape, grads, dict(weight_decay=0.01))
    q, st = p0.clone().reshape(-1), state_for(shape)
    for step, g in enumerate(grads, 1):
        ops.adafactor_step_reference_(q, g.reshape(-1), shape=shape, step=step, weight_decay=0.01, **st)
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", ["avx2", "avx512"])
@pytest.mark.parametrize("shape", [(33, 45), (130, 17), (2, 3, 4, 21), (5000,), (7,)])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_simd_level_bit_identical_to_scalar(level, shape, grad_dtype, out_dtype):
    if level not in ops.cpu_capabilities():
        pytest.skip(f"this CPU has no {level}")
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen).to(grad_dtype) for _ in range(5)]
    results = []
    for lvl in ("scalar", level):
        out = None if out_dtype is None else torch.empty(p0.numel(), dtype=out_dtype)
        p, st = run_native(p0, shape, grads, dict(weight_decay=0.01, maximize=True), capability=lvl, param_out=out)
        results.append((p, st, out))
    (p1, st1, o1), (p2, st2, o2) = results
    assert torch.equal(p1.view(torch.int32), p2.view(torch.int32))
    for name in st1:
        assert torch.equal(st1[name].view(torch.int32), st2[name].view(torch.int32)), name
    if o1 is not None:
        assert torch.equal(o1.view(torch.int16), o2.view(torch.int16))
        assert torch.equal(o1, p1.to(out_dtype))


@pytest.mark.parametrize("shape", [(600, 300), (300_000,), (4, 130, 300)])
def test_thread_count_does_not_change_the_bits(shape):
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    runs = [run_native(p0, shape, grads, {}, threads=t)[0] for t in (1, 2, 3)]
    assert all(torch.equal(runs[0].view(torch.int32), r.view(torch.int32)) for r in runs[1:])


def test_nan_gradient_propagates_like_torch():
    shape = (4, 20)
    g = torch.randn(shape)
    g[1, 3] = float("nan")
    p, _ = run_native(torch.randn(shape), shape, [g], {})
    ref = torch.randn(shape).requires_grad_(True)
    ref.grad = g
    torch.optim.Adafactor([ref]).step()
    assert torch.equal(torch.isnan(p.view(shape)), torch.isnan(ref.detach()))


@pytest.mark.parametrize("bad", [dict(shape=(3, 5)), dict(row_var=None), dict(variance=torch.zeros(15)),
                                 dict(step=0), dict(lr=-1.0), dict(beta2_decay=0.5), dict(d=0.5),
                                 dict(eps1=-1.0), dict(capability="sse9"),
                                 dict(grad=torch.zeros(16, dtype=torch.int32)),
                                 dict(param=torch.zeros(16, dtype=torch.float64)), dict(col_var=torch.zeros(3))])
def test_bad_input_raises_value_error(bad):
    args = dict(param=torch.zeros(16), grad=torch.ones(16), shape=(4, 4), row_var=torch.zeros(4),
                col_var=torch.zeros(4), step=1)
    args.update(bad)
    if "variance" in bad:
        args.update(row_var=None, col_var=None)
    with pytest.raises(ValueError):
        ops.adafactor_step_(args.pop("param"), args.pop("grad"), **args)


@pytest.mark.parametrize("shape, error, match", [
    ((4.0, 4.0), TypeError, "shape must hold ints, got float"),  # (pybind11's dump of the C++ signature)
    ("44", TypeError, "shape must be a sequence of ints"),       # (can't multiply sequence by non-int of type 'str')
    ([[4], [4]], TypeError, "shape must hold ints, got list"),
    ((True, 16), TypeError, "shape must hold ints, got bool"),   # (taken as (1, 16))
    ((-4, -4), ValueError, "shape must hold sizes >= 0"),        # (its product is 16: "expected -4 elements")
], ids=repr)
@pytest.mark.parametrize("step", [ops.adafactor_step_, ops.adafactor_step_reference_], ids=["kernel", "reference"])
def test_a_shape_that_is_not_sizes_names_shape(step, shape, error, match):
    param = torch.zeros(16)
    with pytest.raises(error, match=match):
        step(param, torch.ones(16), shape=shape, row_var=torch.zeros(4), col_var=torch.zeros(4), step=1)
    assert not param.any()


@pytest.mark.parametrize("shape", [torch.Size([4, 4]), [4, 4], "numpy", "tensor"], ids=repr)
def test_a_shape_of_ints_in_any_form_steps_as_the_tuple(shape):
    if shape == "numpy":
        shape = pytest.importorskip("numpy").array([4, 4])
    elif shape == "tensor":
        shape = torch.tensor([4, 4])
    results = []
    for s in ((4, 4), shape):
        torch.manual_seed(0)
        param, row_var, col_var = torch.randn(16), torch.zeros(4), torch.zeros(4)
        ops.adafactor_step_(param, torch.randn(16), shape=s, row_var=row_var, col_var=col_var, step=1)
        results.append(torch.cat([param, row_var, col_var]))
    assert torch.equal(*results)


@pytest.mark.parametrize("case", ["inf", "zero_row", "zero_grad_eps1_0", "zero_row_eps1_1e-30",
                                  "zero_row_eps1_1e-21", "zero_row_eps1_1e-20"])
def test_edge_values_go_as_with_torch(case):
    """Non-finite and zero factors: the kernel's per-row and per-column square roots give torch's NaN, inf and
    finite values where they appear. torch clamps the second moment with eps1 * eps1 in float32: for eps1 below
    about 2.6e-23 (transformers' 1e-30) that is 0, and a row of zero gradients becomes 0 * inf = NaN; just above,
    a subnormal with few bits (1e-21), or a normal float (1e-20)."""
    shape = (6, 20)
    gen = torch.Generator().manual_seed(5)
    p0, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    hyper = {}
    if case == "inf":
        g[2, 7] = float("inf")
    elif case == "zero_row":
        g[3] = 0.0
        g[:, 4] = 0.0
    elif case.startswith("zero_row_eps1_"):
        g[3] = 0.0
        hyper = dict(eps1=float(case[len("zero_row_eps1_"):]), eps2=1e-3)
    else:
        g[1] = 0.0
        hyper = dict(eps1=0.0, eps2=1e-3)
    ref = p0.clone().requires_grad_(True)
    ref.grad = g.clone()
    torch.optim.Adafactor([ref], eps=(hyper.get("eps1"), 1e-3)).step()
    p, _ = run_native(p0, shape, [g], hyper)
    p, want = p.view(shape), ref.detach()
    assert torch.equal(torch.isnan(p), torch.isnan(want))
    assert torch.equal(torch.isinf(p), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(p[finite], want[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(6, 20), (30,)])
def test_infinite_lr_and_d_go_as_with_torch(shape):
    """d=inf (no update clipping) and lr=inf (rho = 1/sqrt(t) uncapped), which torch takes: its step, not a
    refusal."""
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) * 100 for _ in range(3)]
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.Adafactor([ref], lr=float("inf"), d=float("inf"))
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    p, _ = run_native(p0, shape, grads, dict(lr=float("inf"), d=float("inf")))
    torch.testing.assert_close(p.view(shape), ref.detach(), rtol=1e-5, atol=1e-5)
