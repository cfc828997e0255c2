"""int8 Adam's encode at its edges, every SIMD level against the scalar level's bits: first moments on every
midpoint of the signed map (and one float either side), of both signs, beside +-0, subnormals, and blocks whose
maximum is negative, tiny or huge. With beta1 = beta2 = 0 the step's new moments are exactly the gradient (and its
square), so the gradient places each moment where the test wants it."""
import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
from swapio import quant  # noqa: E402

from test_adam_kernel import SIMD_LEVELS, assert_bitwise_equal  # noqa: E402
from test_state_kernels import zero_state  # noqa: E402

EDGE = dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)


def signed_midpoints():
    mags = quant.code_values(True)[127:]  # 0 .. 1.0, ascending
    return (mags[:-1] + mags[1:]) / 2  # float32, as the maps are built


def around(y):
    """y, and the floats just below and above it."""
    return torch.stack([torch.nextafter(y, torch.zeros_like(y)), y, torch.nextafter(y, torch.full_like(y, 2.0))], 1)


def edge_gradients():
    """Blocks of 256: element 0 the block's maximum in magnitude (+-A), the rest y * A for the y under test. A is a
    power of two, so y = |g| / A is exact."""
    ys = around(signed_midpoints()).flatten()
    extra = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-39, 1.0, -1.0, 0.5, 1e-7, 1e-6])
    ys = torch.cat([ys, -ys, extra])
    blocks = []
    for b, scale in enumerate([1.0, 2.0 ** -40, 2.0 ** 100, 2.0 ** -126]):
        for start in range(0, len(ys), 255):
            body = ys[start:start + 255] * scale
            head = torch.tensor([scale if (b + start // 255) % 2 == 0 else -scale])
            blocks.append(torch.cat([head, body, torch.zeros(255 - len(body))]))
    blocks.append(torch.full((256,), 2.0 ** -127))  # a block below FLT_MIN: stored as zeros
    return torch.cat(blocks + [torch.linspace(-1, 1, 37)])  # and a partial block


def step_at(level, g):
    n = g.numel()
    p = torch.linspace(-1, 1, n)
    st = zero_state(n, "int8")
    for step in (1, 2):  # the second step decodes what the first encoded
        ops.adam_step_(p, g, st["exp_avg"], st["exp_avg_sq"], step=step, capability=level,
                       exp_avg_scale=st["exp_avg_scale"], exp_avg_sq_scale=st["exp_avg_sq_scale"], **EDGE)
    return p, st


def test_the_gradients_sit_on_the_midpoints():
    """The inputs do what the level test needs: at every midpoint, the floats either side get different codes."""
    g = edge_gradients()
    _, st = step_at("scalar", g)
    codes = st["exp_avg"][1:256].long()  # the first block (scale 1) after its maximum: 85 midpoints, 3 floats each
    below, above = codes[0:255:3], codes[2:255:3]
    assert torch.all(above == below + 1)


@pytest.mark.parametrize("level", SIMD_LEVELS or [pytest.param("none", marks=pytest.mark.skip("no SIMD level"))])
def test_simd_encode_edges_bit_identical_to_scalar(level):
    g = edge_gradients()
    p0, st0 = step_at("scalar", g)
    p1, st1 = step_at(level, g)
    for name in st0:
        assert_bitwise_equal(st1[name], st0[name], f"{level} {name}")
    assert_bitwise_equal(p1, p0, f"{level} param")
    codes = st0["exp_avg"]
    assert int(codes.min()) == 0 and int(codes.max()) == 255  # -A (the map's -max) and +A both occur



@pytest.mark.parametrize("scales", ["missing", "one for three blocks"])
@pytest.mark.parametrize("step", [ops.adam_step_, ops.adam_step_reference_, ops.lion_step_, ops.lion_step_reference_],
                         ids=lambda f: f.__name__)
def test_int8_state_without_its_scales_is_a_value_error_before_any_write(step, scales):
    """The references raised an AttributeError (missing) or, one scale given for three blocks, torch's broadcast
    error once the parameter was updated; the kernels checked already."""
    torch.manual_seed(0)
    m, m_scale = quant.quantize(torch.randn(600), signed=True)  # 3 blocks
    v, v_scale = quant.quantize(torch.rand(600), signed=False)
    p, g = torch.randn(600), torch.randn(600)
    scale = None if scales == "missing" else m_scale[:1].clone()
    kept = [p.clone(), m.clone(), v.clone(), v_scale.clone()]
    with pytest.raises(ValueError, match="exp_avg_scale"):
        if step.__name__.startswith("adam"):
            step(p, g, m, v, exp_avg_scale=scale, exp_avg_sq_scale=v_scale, step=1, lr=1e-3, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.0)
        else:
            step(p, g, m, exp_avg_scale=scale, step=1, lr=1e-3)
    assert all(torch.equal(a, b) for a, b in zip([p, m, v, v_scale], kept))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [ops.adam_step_, ops.adam_step_reference_, ops.lion_step_, ops.lion_step_reference_],
                         ids=lambda f: f.__name__)
def test_a_scale_given_with_float_state_is_a_value_error_before_any_write(step, dtype):
    """The kernels ignored exp_avg_scale (and exp_avg_sq_scale) given with float moments: a caller that had its
    state mixed up stepped on without a word."""
    p, g = torch.randn(600), torch.randn(600)
    m, v = torch.zeros(600, dtype=dtype), torch.zeros(600, dtype=dtype)
    scale = torch.ones(3)
    kept = [p.clone(), m.clone(), v.clone()]
    for which in (["exp_avg_scale", "exp_avg_sq_scale"] if step.__name__.startswith("adam") else ["exp_avg_scale"]):
        with pytest.raises(ValueError, match=which):
            if step.__name__.startswith("adam"):
                step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                     **{which: scale})
            else:
                step(p, g, m, step=1, lr=1e-3, **{which: scale})
        assert all(torch.equal(a, b) for a, b in zip([p, m, v], kept))


@pytest.mark.parametrize("counter, error", [([0], TypeError), (torch.zeros(1, dtype=torch.int8), ValueError),
                                            (torch.zeros(2, dtype=torch.int64), ValueError),
                                            (torch.zeros(1), ValueError)], ids=["list", "int8", "two", "float"])
@pytest.mark.parametrize("step", [ops.adam_step_, ops.lion_step_], ids=lambda f: f.__name__)
def test_nonfinite_that_is_not_one_int64_is_refused_before_the_step(step, counter, error):
    # (a list: AttributeError once the parameter was written; an int8 counter wrapped; two elements both counted)
    m, m_scale = quant.quantize(torch.zeros(8), signed=True)
    v, v_scale = quant.quantize(torch.zeros(8), signed=False)
    p, g = torch.zeros(8), torch.full((8,), float("nan"))
    with pytest.raises(error, match="nonfinite must be"):
        if step is ops.adam_step_:
            step(p, g, m, v, exp_avg_scale=m_scale, exp_avg_sq_scale=v_scale, step=1, lr=1e-3, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.0, nonfinite=counter)
        else:
            step(p, g, m, exp_avg_scale=m_scale, step=1, lr=1e-3, nonfinite=counter)
    assert not p.any()  # not stepped (NaN otherwise)


@pytest.mark.parametrize("codes, scale, match", [
    (torch.zeros(600, dtype=torch.int8), torch.ones(3), "codes must be torch.uint8"),  # (indexed from the end)
    (torch.zeros(600, dtype=torch.uint8), torch.ones(1), r"3 for 600 codes\), got 1"),  # (broadcast over all)
    (torch.zeros(600, dtype=torch.uint8), torch.ones(4), r"3 for 600 codes\), got 4"),
], ids=["int8 codes", "one scale", "four scales"])
def test_dequantize_refuses_codes_it_would_decode_wrongly(codes, scale, match):
    with pytest.raises(ValueError, match=match):
        quant.dequantize(codes, scale, signed=True)
