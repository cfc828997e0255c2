"""swapio.ops.adam_step_ (the native CPU Adam kernel) against torch.optim.AdamW/Adam and against itself.

References: torch.optim.AdamW / Adam with foreach=False, fused=False (the independent reference), and the
kernel's portable scalar level (every SIMD level must agree with it bit for bit). The kernel differs from
torch only through torch's CPU sqrt, which is not correctly rounded (up to 0.75 ulp), so parameters agree
to about one float32 ulp per step and the moments agree exactly after one step.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
_C = pytest.importorskip("swapio._C")

LEVELS = ops.cpu_capabilities()
SIMD_LEVELS = [lvl for lvl in LEVELS if lvl != "scalar"]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = [1, 15, 17, 1023, (1 << 20) + 7]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state(n, seed=0, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen).mul_(1e-2)
    v = torch.rand(n, generator=gen).mul_(1e-4)
    g = torch.randn(n, generator=gen).mul_(1e-2).to(grad_dtype)
    return p, g, m, v


def clone_all(*ts):
    return [t.clone() for t in ts]


def assert_bitwise_equal(a, b, what=""):
    """Equal bit for bit, except that any NaN matches any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.uint8:  # int8 state codes
        ai, bi, nan = a, b, torch.zeros_like(a, dtype=torch.bool)
    else:
        ai = a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16)
        bi = b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16)
        nan = a.isnan() & b.isnan()
    same = (ai == bi) | nan
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(f"{what}: {int((~same).sum())} elements differ, first at {i}: {a[i]} vs {b[i]}")


def torch_optimizer(p0, *, adamw, weight_decay, maximize=False, amsgrad=False):
    param = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad, foreach=False, fused=False)
    return param, opt


def run_both(n, steps, *, adamw=True, weight_decay=0.0, maximize=False, amsgrad=False,
             grad_dtype=torch.float32, capability=None, threads=1):
    """`steps` steps of swapio and of torch from zero moments; returns (swapio p, m, v), (torch p, m, v)."""
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    param, opt = torch_optimizer(p0, adamw=adamw, weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).mul_(1e-2).to(grad_dtype)
        ops.adam_step_(p, g, m, v, step=step, weight_decay=weight_decay, adamw=adamw, maximize=maximize,
                       amsgrad=amsgrad, max_exp_avg_sq=vmax, threads=threads, capability=capability, **HYPER)
        param.grad = g.float()
        opt.step()
    st = opt.state[param]
    return (p, m, v), (param.detach(), st["exp_avg"], st["exp_avg_sq"])


# --- every SIMD level against the scalar level ------------------------------------------------------------

VARIANTS = [
    dict(adamw=True, weight_decay=0.0),
    dict(adamw=True, weight_decay=0.05),
    dict(adamw=False, weight_decay=0.05),
    dict(adamw=True, weight_decay=0.05, maximize=True),
    dict(adamw=False, weight_decay=0.0, amsgrad=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("level", SIMD_LEVELS or [pytest.param("none", marks=pytest.mark.skip("no SIMD level"))])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_simd_level_bit_identical_to_scalar(level, n, grad_dtype):
    variants = VARIANTS if grad_dtype == torch.float32 else VARIANTS[1:3]
    for kw in variants:
        p, g, m, v = make_state(n, seed=1, grad_dtype=grad_dtype)
        vmax = v.clone() * 1.5
        outs = {}
        for lvl in ("scalar", level):
            pp, mm, vv, vm = clone_all(p, m, v, vmax)
            out16 = torch.empty(n, dtype=torch.bfloat16)
            out_h = torch.empty(n, dtype=torch.float16)
            for step in (1, 2, 3):
                ops.adam_step_(pp, g, mm, vv, step=step, max_exp_avg_sq=vm, param_out=out16 if step < 3 else out_h,
                               capability=lvl, **kw, **HYPER)
            outs[lvl] = (pp, mm, vv, vm, out16, out_h)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "out bf16", "out fp16"),
                              outs["scalar"], outs[level]):
            assert_bitwise_equal(b, a, f"{level} vs scalar, {name}, {kw}")


@pytest.mark.parametrize("level", SIMD_LEVELS or [pytest.param("none", marks=pytest.mark.skip("no SIMD level"))])
def test_simd_level_bit_identical_on_special_values(level):
    # inf, NaN, zeros of both signs, subnormals and huge values in every input
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 3e38, -3e38,
                             1.0, -1.0, 65504.0, 65520.0, 6e-8, 1e-30])
    n = 1000
    gen = torch.Generator().manual_seed(5)
    idx = lambda: torch.randint(0, len(specials), (n,), generator=gen)  # noqa: E731
    p, g, m, v = specials[idx()], specials[idx()], specials[idx()], specials[idx()].abs()
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
        gg = g.to(grad_dtype)
        outs = {}
        for lvl in ("scalar", level):
            pp, mm, vv = clone_all(p, m, v)
            vmax = v.clone()
            out = torch.empty(n, dtype=torch.bfloat16)
            ops.adam_step_(pp, gg, mm, vv, step=1, weight_decay=0.1, adamw=False, amsgrad=True, max_exp_avg_sq=vmax,
                           param_out=out, capability=lvl, **HYPER)
            outs[lvl] = (pp, mm, vv, vmax, out)
        for a, b in zip(outs["scalar"], outs[level]):
            assert_bitwise_equal(b, a, f"{level} vs scalar, special values, grad {grad_dtype}")


# --- against torch.optim -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_one_step_matches_torch(n, adamw, weight_decay):
    (p, m, v), (tp, tm, tv) = run_both(n, 1, adamw=adamw, weight_decay=weight_decay)
    assert_bitwise_equal(m, tm, "exp_avg")  # identical operations, so identical bits
    assert_bitwise_equal(v, tv, "exp_avg_sq")
    torch.testing.assert_close(p, tp, rtol=3e-7, atol=1e-9)  # torch's sqrt is off by up to 0.75 ulp


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kw", [dict(adamw=True, weight_decay=0.05), dict(adamw=False, weight_decay=0.05),
                                dict(adamw=True, weight_decay=0.0, maximize=True),
                                dict(adamw=False, weight_decay=0.0, maximize=True),
                                dict(adamw=True, weight_decay=0.05, amsgrad=True)],
                         ids=["adamw-wd", "adam-l2", "adamw-max", "adam-max", "adamw-amsgrad"])
def test_ten_steps_match_torch(level, kw):
    n = 100_003
    (p, m, v), (tp, tm, tv) = run_both(n, 10, capability=level, **kw)
    torch.testing.assert_close(p, tp, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(m, tm, rtol=1e-6, atol=1e-10)
    torch.testing.assert_close(v, tv, rtol=1e-6, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [17, (1 << 20) + 7])
def test_low_precision_grads_match_torch_on_widened_grads(grad_dtype, n):
    (p, m, v), (tp, tm, tv) = run_both(n, 1, grad_dtype=grad_dtype, weight_decay=0.05)
    assert_bitwise_equal(m, tm, "exp_avg")
    assert_bitwise_equal(v, tv, "exp_avg_sq")
    torch.testing.assert_close(p, tp, rtol=3e-7, atol=1e-9)
    (p, m, v), (tp, tm, tv) = run_both(n, 10, grad_dtype=grad_dtype, weight_decay=0.05)
    torch.testing.assert_close(p, tp, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_finite_low_precision_grad_widens_exactly(level, grad_dtype):
    # with beta1 = 0, exp_avg becomes exactly the (widened) grad
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    g = bits.view(grad_dtype)
    g = g[g.isfinite()].contiguous()
    n = g.numel()
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    ops.adam_step_(p, g, m, v, step=1, lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   capability=level)
    assert_bitwise_equal(m, g.float(), "exp_avg == grad.float()")


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_param_out_equals_param_to_dtype(level, out_dtype):
    # a real step on ordinary values, then lr=0 steps on arbitrary float bit patterns (inf, NaN, subnormals,
    # values on rounding ties): param_out must equal param.to(out_dtype) bit for bit, NaN for NaN
    p, g, m, v = make_state((1 << 16) + 3, seed=2)
    out = torch.empty(p.numel(), dtype=out_dtype)
    ops.adam_step_(p, g, m, v, step=1, weight_decay=0.01, param_out=out, capability=level, **HYPER)
    assert_bitwise_equal(out, p.to(out_dtype), "param_out after a step")

    gen = torch.Generator().manual_seed(3)
    patterns = torch.randint(-(1 << 31), 1 << 31, (1 << 16,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = torch.arange(1 << 12, dtype=torch.int32) << 12 | 0x1000  # halfway cases of fp16 and bf16
    ties16 = torch.arange(1 << 12, dtype=torch.int32) << 16 | 0x8000
    p = torch.cat([patterns, ties, ties16, -ties16 - 1]).view(torch.float32).contiguous()
    p = torch.cat([p, torch.tensor([float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0,
                                    2.0 ** -25, 2.0 ** -24 * 1.5, 3.4e38, -0.0])])
    n = p.numel()
    expected = p.to(out_dtype)
    out = torch.empty(n, dtype=out_dtype)
    ops.adam_step_(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.0, param_out=out, capability=level)
    assert_bitwise_equal(out, expected, "param_out on bit patterns")
    assert_bitwise_equal(out, p.to(out_dtype), "param_out vs updated param")


def test_threads_give_identical_results():
    n = (1 << 21) + 7
    p, g, m, v = make_state(n, seed=4, grad_dtype=torch.bfloat16)
    results = []
    for threads in (1, 2, 3):
        pp, mm, vv = clone_all(p, m, v)
        out = torch.empty(n, dtype=torch.bfloat16)
        ops.adam_step_(pp, g, mm, vv, step=3, weight_decay=0.01, param_out=out, threads=threads, **HYPER)
        results.append((pp, mm, vv, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise_equal(b, a, "threads")


def test_reference_is_torch_op_for_op():
    for kw in VARIANTS:
        n = 10_007
        gen = torch.Generator().manual_seed(6)
        p0 = torch.randn(n, generator=gen)
        p, m, v, vmax = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
        param, opt = torch_optimizer(p0, **kw)
        for step in range(1, 4):
            g = torch.randn(n, generator=gen)
            ops.adam_step_reference_(p, g, m, v, step=step, max_exp_avg_sq=vmax, **kw, **HYPER)
            param.grad = g
            opt.step()
        assert_bitwise_equal(p, param.detach(), f"reference vs torch, {kw}")
        assert_bitwise_equal(m, opt.state[param]["exp_avg"], "exp_avg")


def test_lr_as_tensor_and_step_as_tensor():
    p, g, m, v = make_state(1000, seed=7)
    a = clone_all(p, m, v)
    b = clone_all(p, m, v)
    ops.adam_step_(a[0], g, a[1], a[2], step=4, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    ops.adam_step_(b[0], g, b[1], b[2], step=torch.tensor(4.0), lr=torch.tensor(0.01, dtype=torch.float64),
                   beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    for x, y in zip(a, b):
        assert_bitwise_equal(x, y, "tensor hyperparameters")


def test_empty_tensors_are_a_no_op():
    e = torch.empty(0)
    assert ops.adam_step_(e, e.clone(), e.clone(), e.clone(), step=1, weight_decay=0.0, **HYPER) is e


def test_cpu_capability_reports_the_best_level_by_default():
    if os.environ.get("SWAPIO_CPU_CAPABILITY"):
        pytest.skip("SWAPIO_CPU_CAPABILITY is set")
    assert ops.cpu_capability() == LEVELS[-1]
    assert LEVELS[0] == "scalar"


# --- bad input ---------------------------------------------------------------------------------------------

def good_args(n=8):
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


def call(overrides=None, **kw):
    args = good_args()
    args.update(overrides or {})
    hyper = dict(step=1, weight_decay=0.0, **HYPER)
    hyper.update(kw)
    return ops.adam_step_(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **hyper)


@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq"])
def test_non_tensor_raises_type_error(name):
    with pytest.raises(TypeError):
        call({name: [0.0] * 8})


@pytest.mark.parametrize("overrides,kw", [
    ({"param": torch.zeros(8, device="meta")}, {}),
    ({"grad": torch.zeros(16)[::2]}, {}),
    ({"exp_avg": torch.zeros(8, 2).t()}, {}),
    ({"param": torch.zeros(8, dtype=torch.float64)}, {}),
    ({"exp_avg": torch.zeros(8, dtype=torch.bfloat16)}, {}),
    ({"exp_avg_sq": torch.zeros(8, dtype=torch.float16)}, {}),
    ({"grad": torch.zeros(8, dtype=torch.int32)}, {}),
    ({"grad": torch.zeros(8, dtype=torch.float64)}, {}),
    ({"grad": torch.zeros(9)}, {}),
    ({"exp_avg_sq": torch.zeros(7)}, {}),
    ({}, {"param_out": torch.zeros(8, dtype=torch.int8)}),
    ({}, {"param_out": torch.zeros(9, dtype=torch.bfloat16)}),
    ({}, {"param_out": torch.zeros(16, dtype=torch.bfloat16)[::2]}),
    ({}, {"step": 0}),
    ({}, {"step": 1.5}),
    ({}, {"lr": -1.0}),
    ({}, {"lr": float("nan")}),
    ({}, {"eps": -1e-8}),
    ({}, {"beta1": 1.0}),
    ({}, {"beta2": -0.1}),
    ({}, {"weight_decay": -0.1}),
    ({}, {"lr": torch.tensor([1e-3, 1e-3])}),
    ({}, {"amsgrad": True}),
    ({}, {"amsgrad": True, "max_exp_avg_sq": torch.zeros(8, dtype=torch.bfloat16)}),
    ({}, {"threads": -1}),
    ({}, {"capability": "sse9"}),
], ids=lambda x: repr(x)[:40])
def test_bad_argument_raises_value_error(overrides, kw):
    with pytest.raises(ValueError):
        call(overrides, **kw)


_STEPS = {
    "adam": lambda t, step: ops.adam_step_(*t, torch.zeros(8), step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                           weight_decay=0.0),
    "lion": lambda t, step: ops.lion_step_(*t, step=step, lr=1e-3),
    "adafactor": lambda t, step: ops.adafactor_step_(t[0], t[1], shape=(8,), variance=t[2], step=step),
}


@pytest.mark.parametrize("step", [2**63, 2**64, 1e19], ids=repr)
@pytest.mark.parametrize("kernel", sorted(_STEPS))
def test_a_step_past_int64_is_a_value_error_naming_step(kernel, step):
    # it reached the int64 binding, whose TypeError dumped pybind11's C++ signature
    t = (torch.zeros(8), torch.ones(8), torch.zeros(8))
    with pytest.raises(ValueError, match="step must be <= 2\\*\\*63 - 1"):
        _STEPS[kernel](t, step)
    assert not t[0].any() and not t[2].any()  # nothing was written


_BF16_STEPS = {
    "adam": lambda step, t, index_base: step(t[0], t[1], t[2], t[3], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                                             eps=1e-8, weight_decay=0.0, index_base=index_base),
    "lion": lambda step, t, index_base: step(t[0], t[1], t[2], lr=1e-3, index_base=index_base),
}


@pytest.mark.parametrize("kernel", sorted(_BF16_STEPS))
def test_index_base_up_to_int64_matches_the_reference_and_past_it_is_a_value_error(kernel):
    # past 2**63 - 1 it reached the int64 binding of a bf16 state (pybind11's dump of the C++ signature)
    def state():
        torch.manual_seed(0)
        return (torch.randn(8), torch.randn(8), torch.randn(8).bfloat16(), torch.rand(8).bfloat16())
    native, reference = getattr(ops, kernel + "_step_"), getattr(ops, kernel + "_step_reference_")
    last = 2**63 - 8  # its 8 elements' indices end at 2**63 - 1
    a, b = state(), state()
    _BF16_STEPS[kernel](native, a, last)
    _BF16_STEPS[kernel](reference, b, last)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for step in (native, reference):
        for index_base in (last + 1, 2**64):
            t = state()
            with pytest.raises(ValueError, match="index_base"):
                _BF16_STEPS[kernel](step, t, index_base)
            assert all(torch.equal(x, y) for x, y in zip(t, state()))  # nothing was written


def test_binding_rejects_bad_raw_arguments():
    t = torch.zeros(8)
    ptr = t.data_ptr()
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError):
        _C.adam_step(ptr, ptr, 7, ptr, ptr, 8, **hyper)  # unknown grad dtype code
    with pytest.raises(ValueError):
        _C.adam_step(ptr, 0, 0, ptr, ptr, 8, **hyper)  # null grad
    with pytest.raises(ValueError):
        _C.adam_step(ptr, ptr, 0, ptr, ptr, -1, **hyper)  # negative size
    with pytest.raises(ValueError):
        _C.adam_step(ptr, ptr, 0, ptr, ptr, 8, **dict(hyper, step=0))
    with pytest.raises(ValueError):
        _C.adam_step(ptr, ptr, 0, ptr, ptr, 8, capability="mmx", **hyper)
    with pytest.raises(ValueError):
        _C.adam_step(ptr, ptr, 0, ptr, ptr, 8, out_dtype=1, **hyper)  # param_out code without a pointer


def test_explicit_capability_the_cpu_lacks_raises_value_error():
    missing = [lvl for lvl in ("scalar", "avx2", "avx512") if lvl not in LEVELS]
    if not missing:
        pytest.skip("this CPU supports every level")
    with pytest.raises(ValueError):
        call(capability=missing[-1])


# --- process-level behaviour (subprocesses) ----------------------------------------------------------------

def run_python(code, env_extra=None, timeout=60):
    env = dict(os.environ)
    env.pop("SWAPIO_CPU_CAPABILITY", None)
    env.update(env_extra or {})
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_env_var_forces_capability(level):
    r = run_python("""
        import warnings, torch
        warnings.simplefilter("error")
        import swapio.ops as ops
        p = torch.zeros(100)
        ops.adam_step_(p, torch.ones(100), torch.zeros(100), torch.zeros(100), step=1, lr=1e-3, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=0.0)
        print(ops.cpu_capability())
    """, {"SWAPIO_CPU_CAPABILITY": level.upper()})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == level


@pytest.mark.slow
def test_env_var_with_unknown_level_warns_and_uses_the_best():
    r = run_python("""
        import warnings
        import swapio.ops as ops
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            level = ops.cpu_capability()
        print(level, len(w), w[0].category.__name__ if w else "-")
    """, {"SWAPIO_CPU_CAPABILITY": "avx9000"})
    assert r.returncode == 0, r.stderr
    level, nwarn, category = r.stdout.split()
    assert level == LEVELS[-1] and nwarn == "1" and category == "SwapioWarning"


@pytest.mark.slow
def test_pool_starts_lazily_runs_small_steps_inline_and_exits_cleanly():
    r = run_python("""
        import os, torch
        import swapio.ops as ops, swapio._C as C
        bufs = {n: [torch.zeros(n) for _ in range(4)] for n in (100_000, 1 << 20)}
        def step(n, threads):
            p, g, m, v = bufs[n]
            g.fill_(1.0)
            ops.adam_step_(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           threads=threads)
            return p
        step(100_000, 2)
        print(C.adam_pool_workers())
        step(1 << 20, 2)
        print(C.adam_pool_workers())
        bufs[1 << 20][0].zero_()
        pid = os.fork()
        if pid == 0:  # the child has none of the parent's workers: it must start its own, not hang
            p, g, m, v = bufs[1 << 20]  # (no torch kernels here: torch's OpenMP pool is not fork-safe)
            ops.adam_step_(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           threads=2)
            os._exit(0 if bool(p.numpy().all()) else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1", "0"]
