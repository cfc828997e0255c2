"""The smaller-state kernels: Adam with bf16 / int8 moments and Lion with fp32 / bf16 / int8 moments.

References: the plain-torch steps (swapio.ops.*_reference_, decoding and encoding with swapio.quant) and the
kernel's own scalar level (every SIMD level must give its bits). The moments match the references bit for bit
(same float32 operations); parameters agree to float32 rounding, since torch's CPU sqrt is not correctly rounded.
"""
import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
_C = pytest.importorskip("swapio._C")
from swapio import quant  # noqa: E402

from test_adam_kernel import SIMD_LEVELS, assert_bitwise_equal  # noqa: E402

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LION = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
SEED = 0xC0FFEE


def zero_state(n, state, moments=2):
    """Fresh moments of `state` ("fp32", "bf16", "int8") as keyword arguments of the kernels."""
    names = ("exp_avg", "exp_avg_sq")[:moments]
    if state == "int8":
        out = {}
        for name, signed in zip(names, (True, False)):
            codes, scale = quant.quantize(torch.zeros(n), signed)
            out[name], out[name + "_scale"] = codes, scale
        return out
    dtype = torch.float32 if state == "fp32" else torch.bfloat16
    return {name: torch.zeros(n, dtype=dtype) for name in names}


def clone_state(st):
    return {k: v.clone() for k, v in st.items()}


def grads(n, steps, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # mixed magnitudes, so blocks span several decades of the int8 map
    return [(torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4) * 1e-2).to(dtype)
            for _ in range(steps)]


def run(fn, p, gs, st, **kw):
    nonfinite = torch.zeros(1, dtype=torch.int64)
    for step, g in enumerate(gs, 1):
        if fn in (ops.adam_step_, ops.adam_step_reference_):
            fn(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, seed=SEED, nonfinite=nonfinite,
               exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"), **kw)
        else:
            fn(p, g, st["exp_avg"], step=step, seed=SEED, nonfinite=nonfinite,
               exp_avg_scale=st.get("exp_avg_scale"), **kw)
    return int(nonfinite)


CASES = [("adam", "bf16"), ("adam", "int8"), ("lion", "fp32"), ("lion", "bf16"), ("lion", "int8")]


def kernel_and_reference(algo):
    if algo == "adam":
        return ops.adam_step_, ops.adam_step_reference_, ADAM, 2
    return ops.lion_step_, ops.lion_step_reference_, LION, 1


@pytest.mark.parametrize("algo,state", CASES)
@pytest.mark.parametrize("n", [17, 1000, 70_001])
def test_kernel_matches_plain_torch_reference(algo, state, n):
    kernel, reference, hyper, moments = kernel_and_reference(algo)
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
    gs = grads(n, 3, seed=n)
    st_k, st_r = zero_state(n, state, moments), zero_state(n, state, moments)
    pk, pr = p0.clone(), p0.clone()
    run(kernel, pk, gs, st_k, **hyper)
    run(reference, pr, gs, st_r, **hyper)
    for name in st_k:
        assert_bitwise_equal(st_k[name], st_r[name], f"{algo} {state} {name}")
    if algo == "lion":  # no sqrt: the same bits
        assert_bitwise_equal(pk, pr, "param")
    else:
        torch.testing.assert_close(pk, pr, rtol=1e-6, atol=1e-9)
    assert not torch.equal(pk, p0)


@pytest.mark.slow
@pytest.mark.parametrize("level", SIMD_LEVELS or [pytest.param("none", marks=pytest.mark.skip("no SIMD level"))])
@pytest.mark.parametrize("algo,state", CASES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,maximize", [(3 * 256 + 19, False), (3 * 256 + 19, True), (300_007, False),
                                        (300_007, True)], ids=lambda v: str(v))
def test_simd_level_bit_identical_to_scalar(level, algo, state, grad_dtype, n, maximize):
    """n: a partial block and a partial vector; and enough blocks for the pipelined loops (decode, step and
    encode of different blocks interleaved), with non-finite gradients deep inside; maximize flips the gradient
    (a loop-invariant branch of its own)."""
    kernel, _, hyper, moments = kernel_and_reference(algo)
    hyper = dict(hyper, maximize=maximize)
    gs = grads(n, 3, seed=1, dtype=grad_dtype)
    gs[1][5] = float("nan")  # non-finite gradients
    gs[2][300] = float("inf")
    gs[2][n - 7] = -float("inf")
    gs[0][n // 2] = float("nan")
    outs = {}
    for lvl in ("scalar", level):
        p = torch.randn(n, generator=torch.Generator().manual_seed(2))
        st = zero_state(n, state, moments)
        out = torch.empty(n, dtype=torch.bfloat16)
        count = run(kernel, p, gs, st, capability=lvl, param_out=out, **hyper)
        outs[lvl] = (p, out, st, count)
    (p0, o0, s0, c0), (p1, o1, s1, c1) = outs["scalar"], outs[level]
    assert_bitwise_equal(p1, p0, "param")
    assert_bitwise_equal(o1, o0, "param_out")
    for name in s0:
        assert_bitwise_equal(s1[name], s0[name], name)
    assert c0 == c1


@pytest.mark.parametrize("algo,state", [("adam", "bf16"), ("adam", "int8"), ("lion", "int8")])
def test_threads_and_block_aligned_chunks_give_the_same_bits(algo, state):
    kernel, _, hyper, moments = kernel_and_reference(algo)
    n = (1 << 19) + 300
    gs = grads(n, 2, seed=3)
    results = []
    for threads, cut in ((1, None), (2, None), (2, 256 * 999)):
        p = torch.randn(n, generator=torch.Generator().manual_seed(4))
        st = zero_state(n, state, moments)
        for step, g in enumerate(gs, 1):
            pieces = [(0, n)] if cut is None else [(0, cut), (cut, n)]
            for a, b in pieces:  # a chunk of a tensor: its own views, index_base = its first element
                blk = slice(a // 256, quant.num_blocks(b))
                kw = {k: (v[blk] if k.endswith("_scale") else v[a:b]) for k, v in st.items()}
                scales = {k: kw.pop(k) for k in list(kw) if k.endswith("_scale")}
                args = [kw["exp_avg"], kw["exp_avg_sq"]] if moments == 2 else [kw["exp_avg"]]
                kernel(p[a:b], g[a:b], *args, step=step, seed=SEED, index_base=a, threads=threads, **scales, **hyper)
        results.append((p, st))
    for p, st in results[1:]:
        assert_bitwise_equal(p, results[0][0], "param")
        for name in st:
            assert_bitwise_equal(st[name], results[0][1][name], name)


def test_int8_nan_gradient_does_not_poison_its_block():
    n = 512
    gs = grads(n, 2, seed=5)
    clean = zero_state(n, "int8")
    p_clean = torch.ones(n)
    run(ops.adam_step_, p_clean, gs, clean, **ADAM)
    bad = zero_state(n, "int8")
    p_bad = torch.ones(n)
    gs[1] = gs[1].clone()
    gs[1][7] = float("nan")
    count = run(ops.adam_step_, p_bad, gs, bad, **ADAM)
    assert count == 1  # reported, not silent
    assert torch.isnan(p_bad[7])  # the parameter takes the NaN update, as with fp32 state
    m = quant.dequantize(bad["exp_avg"], bad["exp_avg_scale"], True)
    v = quant.dequantize(bad["exp_avg_sq"], bad["exp_avg_sq_scale"], False)
    assert m[7] == 0 and v[7] == 0  # the element's state is reset to zero
    assert torch.isfinite(m).all() and torch.isfinite(v).all() and torch.isfinite(bad["exp_avg_scale"]).all()
    # the other 255 elements of block 0 and all of block 1 keep state within int8 resolution of the clean run
    others = torch.ones(n, dtype=torch.bool)
    others[7] = False
    m_clean = quant.dequantize(clean["exp_avg"], clean["exp_avg_scale"], True)
    assert bad["exp_avg_scale"][0] > 0
    torch.testing.assert_close(m[others], m_clean[others], rtol=0.05, atol=float(clean["exp_avg_scale"][0]) * 0.01)
    assert torch.equal(p_bad[256:], p_clean[256:])


def test_bf16_stochastic_rounding_keeps_small_updates():
    # exp_avg_sq moves by (1 - beta2) * (g^2 - v) = 0.003 per step from v = 1: less than half a bf16 ulp at 1
    # (2^-8), so round-to-nearest would keep v at exactly 1 forever; stochastic rounding tracks fp32 on average.
    n, steps = 20_000, 100
    g = torch.full((n,), 2.0)
    st = {"exp_avg": torch.zeros(n, dtype=torch.bfloat16), "exp_avg_sq": torch.ones(n, dtype=torch.bfloat16)}
    v32 = torch.ones(n)
    for step in range(1, steps + 1):
        ops.adam_step_(torch.zeros(n), g, st["exp_avg"], st["exp_avg_sq"], step=step, seed=SEED, **ADAM)
        v32.mul_(0.999).addcmul_(g, g, value=0.001)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(steps):
        nearest = nearest.float().mul_(0.999).addcmul_(g, g, value=0.001).to(torch.bfloat16)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))  # why: nearest rounding stalls
    mean = st["exp_avg_sq"].float().mean()
    assert abs(mean / v32[0] - 1) < 2e-3, (float(mean), float(v32[0]))


def test_bf16_rounding_depends_on_seed_and_step_only():
    n = 4096
    outs = []
    for seed in (1, 1, 2):
        st = zero_state(n, "bf16")
        p = torch.zeros(n)
        ops.adam_step_(p, torch.full((n,), 0.3), st["exp_avg"], st["exp_avg_sq"], step=1, seed=seed, **ADAM)
        outs.append(st["exp_avg"].view(torch.int16))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_native_code_values_are_the_published_maps():
    for signed in (True, False):
        assert torch.equal(torch.tensor(_C.quant_map(signed), dtype=torch.float32), quant.code_values(signed))
    s, u = quant.code_values(True), quant.code_values(False)
    assert (s == 0).sum() == 1 and s.max() == 1.0 and s.min() > -1.0 and (s < 0).sum() == 127
    assert u.min() == 0 and u.max() == 1.0 and (u > 0).sum() == 255
    # 7 decades: the smallest nonzero magnitudes are a few 1e-7 of the block scale
    assert 1e-7 < u[1] < 1e-6 and 1e-7 < s[128] < 1e-6
    # each value within a few float32 ulps of the published decimal formula (it is one float32 multiply-add)
    for signed, values in ((True, s[127:]), (False, u)):
        ideal = [0.0]
        for i, decade in enumerate((1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)):
            parts = (1 << i) if signed else (2 << i)
            ideal += [decade * (0.1 + 0.9 * (j + 0.5) / parts) for j in range(parts)]
        ideal = torch.tensor(ideal + [1.0], dtype=torch.float64)
        ulp = torch.nextafter(ideal.float(), torch.tensor(2.0)).double() - ideal.float().double()
        assert values.numel() == ideal.numel() and bool(((values.double() - ideal).abs() <= 8 * ulp).all())


def test_quantize_picks_the_nearest_code_and_keeps_signs():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4096, generator=gen) * torch.rand(4096, generator=gen).pow(3)
    for signed, values in ((True, x), (False, x.square())):
        codes, scale = quant.quantize(values, signed)
        back = quant.dequantize(codes, scale, signed)
        candidates = quant.code_values(signed)[None, :] * scale.repeat_interleave(256)[:, None]
        best = (candidates - values[:, None]).abs().amin(1)
        assert bool(((back - values).abs() <= best * (1 + 1e-6) + 1e-30).all())
        assert torch.equal(scale, values.abs().view(-1, 256).amax(1))
        if not signed:
            assert bool((back >= 0).all())
        nz = back != 0
        assert torch.equal(torch.sign(back[nz]), torch.sign(values[nz]))


@pytest.mark.parametrize("bad", [
    dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)),                         # moments of two dtypes
    dict(exp_avg=torch.zeros(8, dtype=torch.uint8), exp_avg_sq=torch.zeros(8, dtype=torch.uint8)),  # no scales
    dict(exp_avg=torch.zeros(8, dtype=torch.uint8), exp_avg_sq=torch.zeros(8, dtype=torch.uint8),
         exp_avg_scale=torch.zeros(2), exp_avg_sq_scale=torch.zeros(1)),        # scales of the wrong size
    dict(exp_avg=torch.zeros(8, dtype=torch.int8), exp_avg_sq=torch.zeros(8, dtype=torch.int8)),
    dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16), exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16),
         amsgrad=True, max_exp_avg_sq=torch.zeros(8)),
    dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16), exp_avg_sq=torch.zeros(8, dtype=torch.bfloat16), seed=-1),
    dict(index_base=-3),
], ids=range(7))
def test_adam_state_bad_input_raises_value_error(bad):
    kw = dict(exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8))
    kw.update(bad)
    m, v = kw.pop("exp_avg"), kw.pop("exp_avg_sq")
    with pytest.raises(ValueError):
        ops.adam_step_(torch.zeros(8), torch.zeros(8), m, v, step=1, **ADAM, **kw)


@pytest.mark.parametrize("bad", [dict(beta1=1.5), dict(beta2=-0.1), dict(lr=-1.0), dict(weight_decay=float("nan")),
                                 dict(step=0), dict(capability="sse9"), dict(exp_avg=torch.zeros(8, dtype=torch.uint8))],
                         ids=range(7))
def test_lion_bad_input_raises_value_error(bad):
    kw = dict(LION, exp_avg=torch.zeros(8))
    kw.update(bad)
    with pytest.raises(ValueError):
        ops.lion_step_(torch.zeros(8), torch.zeros(8), kw.pop("exp_avg"), **kw)


@pytest.mark.parametrize("algo,state", CASES + [("adam", "fp32")])
def test_a_step_runs_no_torch_operator(algo, state):
    """The step checks its arguments from tensor metadata, and the native core checks the data (an int8 block
    scale with its sign bit set) on the calling thread. A torch operator on the data here (the scale check was
    torch.signbit(scale).any()) ran on torch's OpenMP threads, which then spin-wait for more work through the
    kernel: on 2 cores that took one from the kernel's threads, and int8 steps ran 20-25 % slower."""
    kernel, _, hyper, moments = kernel_and_reference(algo)
    n = 70_001
    p, g = torch.randn(n), torch.randn(n)
    p0 = p.clone()
    st = zero_state(n, state, moments)
    scales = {k: v for k, v in st.items() if k.endswith("_scale")}
    moments_in = [st[k] for k in ("exp_avg", "exp_avg_sq")[:moments]]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in (1, 2):
            kernel(p, g, *moments_in, step=step, threads=2, **scales, **hyper)
    assert not torch.equal(p, p0)
    assert [e.name for e in prof.events() if e.name.startswith("aten::")] == []
