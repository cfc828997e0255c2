"""The int8-state encode of the SIMD levels against the scalar level, bit for bit, on inputs aimed at its edges.

The AVX2 Adam encode packs 32 unclamped codes and regions to bytes, clamps them with one table lookup and maps a
negative first moment to 2 * 127 - c (saturating at 0); the other levels search the codes their own ways. Here
each level runs in lockstep with capability="scalar" for several steps and must give its bits after every step:
moments y = |x| / absmax exactly on, and one float either side of, every midpoint of both maps (and on every code,
and a quarter of the way between codes), +0 and -0, subnormal moments and gradients, blocks whose absmax is
negative, at or one float around FLT_MIN, near FLT_MAX (a subnormal 1 / absmax, and y above 1), lengths that are
not whole blocks or vectors, and tensors long enough that two or three threads take the longer int8 tiles.

Crafting exact moments: with beta1 = beta2 = 0 Adam's new moments are m = g and v = g * g (one rounding),
whatever the state was (Lion's m = g with beta2 = 0, g != 0); with beta1 = beta2 = 0.5 and g = 0 they are the
decoded state halved, exactly. Each crafted step's scalar codes are also checked against codes expected
independently (the nearest magnitude, ties toward zero) or against swapio.quant's plain-torch encoding, so the
inputs really land where they aim.
"""
import functools

import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
from swapio import quant  # noqa: E402

from test_adam_kernel import assert_bitwise_equal  # noqa: E402

F32 = torch.float32
FLT_MIN = torch.finfo(F32).tiny
FLT_MAX = torch.finfo(F32).max
BLOCK = quant.BLOCK
SEED = 0x5EED
ZERO = 127  # the signed map's code of 0

ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ADAM_EXACT = dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)  # m = g, v = g * g
ADAM_HALF = dict(lr=1e-3, beta1=0.5, beta2=0.5, eps=1e-8, weight_decay=0.0)   # with g = 0: m, v halved
LION = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
LION_EXACT = dict(lr=1e-3, beta1=0.9, beta2=0.0, weight_decay=0.0)            # m = g (g != 0)
LION_HALF = dict(lr=1e-3, beta1=0.9, beta2=0.5, weight_decay=0.0)             # with g = 0: m halved


def level_param(level):
    """A SIMD level, skipped (with the reason) only where this CPU lacks it."""
    missing = level not in ops.cpu_capabilities()
    return pytest.param(level, marks=pytest.mark.skipif(missing, reason=f"this CPU does not support {level}"))


LEVELS = [level_param("avx2"), level_param("avx512")]
ALGOS = ["adam", "lion"]


def f32(x):
    return torch.tensor(x, dtype=F32)


def up(t):
    return torch.nextafter(t, torch.full_like(t, 2.0))


def down(t):
    return torch.nextafter(t, torch.zeros_like(t))


def ulps(t, d):
    """t (finite, >= 0) moved by d floats."""
    return (t.view(torch.int32) + d).view(F32)


def hypers(algo):
    """(exact, half, ordinary) hyperparameters of algo."""
    return (ADAM_EXACT, ADAM_HALF, ADAM) if algo == "adam" else (LION_EXACT, LION_HALF, LION)


def zero_state(n, algo):
    st = {}
    for name, signed in (("exp_avg", True), ("exp_avg_sq", False))[:2 if algo == "adam" else 1]:
        st[name], st[name + "_scale"] = quant.quantize(torch.zeros(n), signed)
    return st


def step_(algo, p, g, st, step, capability, threads, hyper):
    """One step of the int8 kernel; returns how many non-finite moments it dropped."""
    nonfinite = torch.zeros(1, dtype=torch.int64)
    common = dict(step=step, seed=SEED, nonfinite=nonfinite, capability=capability, threads=threads,
                  exp_avg_scale=st["exp_avg_scale"], **hyper)
    if algo == "adam":
        ops.adam_step_(p, g, st["exp_avg"], st["exp_avg_sq"], exp_avg_sq_scale=st["exp_avg_sq_scale"], **common)
    else:
        ops.lion_step_(p, g, st["exp_avg"], **common)
    return int(nonfinite)


def lockstep(algo, configs, p0, state0, steps):
    """Runs the steps [(grad, hyper), ...] from (p0, state0) under every (capability, threads) of configs,
    comparing each with configs[0] bit for bit after every step. Returns configs[0]'s (state, nonfinite) after each
    step."""
    runs = [(cfg, p0.clone(), {k: v.clone() for k, v in state0.items()}) for cfg in configs]
    history = []
    for step, (g, hyper) in enumerate(steps, 1):
        counts = [step_(algo, p, g, st, step, cap, threads, hyper) for (cap, threads), p, st in runs]
        _, p_ref, st_ref = runs[0]
        for ((cap, threads), p, st), count in zip(runs[1:], counts[1:]):
            what = f"{algo} {cap} threads={threads} vs {configs[0]}, step {step}"
            for name in st:
                assert_bitwise_equal(st[name], st_ref[name], f"{what}: {name}")
            assert_bitwise_equal(p, p_ref, f"{what}: param")
            assert count == counts[0], what
        history.append(({k: v.clone() for k, v in st_ref.items()}, counts[0]))
    return history


def expected_state(algo, m, v=None):
    """swapio.quant's encoding of new fp32 moments (Adam's pairs with a non-finite member dropped first)."""
    out = {}
    if algo == "adam":
        m, v = m.clone(), v.clone()
        quant.drop_nonfinite_pairs(m, v)
        out["exp_avg_sq"], out["exp_avg_sq_scale"] = quant.quantize(v, False)
    out["exp_avg"], out["exp_avg_scale"] = quant.quantize(m, True)
    return out


def exact_moments(algo, g):
    """The new moments of an exact step (ADAM_EXACT / LION_EXACT): m = g (Lion's +-0 come out as some zero,
    which encodes alike) and v = g * g."""
    return (g.clone() if algo == "adam" else torch.where(g == 0, 0.0, g)), g * g


def assert_state(st, want, what):
    for name in want:
        assert_bitwise_equal(st[name], want[name], f"{what}: {name}")


# ---- y on, and one float either side of, every midpoint --------------------------------------------------------

def magnitudes(signed):
    """A map's magnitudes 0 .. 1, ascending (the signed map's are those of its non-negative codes)."""
    codes = quant.code_values(signed)
    return codes[ZERO:] if signed else codes


def targets(signed):
    """(y, k): y one float below, on and one float above every midpoint between magnitudes (float32, as the
    kernels' midpoints), every magnitude, and a quarter and three quarters of the way between magnitudes; k the
    index of the nearest magnitude, ties toward zero, which every level must encode."""
    mags = magnitudes(signed)
    mids = (mags[:-1] + mags[1:]) / 2
    gap = mags[1:] - mags[:-1]
    lo = torch.arange(mids.numel())
    ys = torch.cat([down(mids), mids, up(mids), mags, mags[:-1] + 0.25 * gap, mags[:-1] + 0.75 * gap])
    ks = torch.cat([lo, lo, lo + 1, torch.arange(mags.numel()), lo, lo + 1])
    # every midpoint lies strictly between its magnitudes, so the three y around it are distinct and bracket it
    assert bool((mags[:-1] < down(mids)).all() and (up(mids) < mags[1:]).all())
    assert torch.equal(ks, torch.searchsorted(mids, ys))  # k = the number of midpoints below y
    return ys, ks


def code_of(k, negative, signed):
    """The code of a moment of magnitude index k (negative: the signed map has no -1.0, so -1.0 takes -mags[127])."""
    if not signed:
        return k
    return torch.where(negative, ZERO - k.clamp(max=ZERO), ZERO + k)


def squares_hitting(ys):
    """For each y: (g, head) with fl(fl(g * g) * fl(1 / fl(head * head))) == y and g <= head: in a block whose
    largest |g| is head, Adam's v = g * g (beta2 = 0) has exactly that y. Not every float is a rounded square,
    so some y need a head other than 1 (a few floats above it)."""
    g_of, head_of = torch.zeros_like(ys), torch.zeros_like(ys)
    found = torch.zeros_like(ys, dtype=torch.bool)
    for d in range(4096):
        head = ulps(f32(1.0), d)
        s = head * head
        inv = 1 / s
        g0 = (ys.double() * float(s)).sqrt().float()
        for e in range(-3, 4):
            g = ulps(g0, e)
            hit = ~found & (g <= head) & ((g * g) * inv == ys)
            g_of[hit], head_of[hit] = g[hit], head
            found |= hit
        if found.all():
            return g_of, head_of
    raise AssertionError(f"no square hits {ys[~found]}")


def blocks_of(values, head, extra=None):
    """Blocks of BLOCK: each the head (the block's absmax) and up to BLOCK - 1 values (the last block's repeat
    from the start); extra: per-value data laid out alike (the head's entry -1)."""
    per = BLOCK - 1
    nblk = -(-values.numel() // per)
    idx = torch.arange(nblk * per) % values.numel()
    out = torch.cat([torch.full((nblk, 1), float(head)), values[idx].view(nblk, per)], 1).reshape(-1)
    if extra is None:
        return out
    ex = torch.cat([torch.full((nblk, 1), -1, dtype=extra.dtype), extra[idx].view(nblk, per)], 1).reshape(-1)
    return out, ex


class Crafted:
    """Gradients whose exact-step moments land on every target: blocks with head 1.0 and y = |g| of the signed
    map's targets, of both signs (k_m: their magnitude indices, -1 elsewhere), and for Adam blocks whose v = g * g
    hits the unsigned map's (k_v); then 2 blocks and 37 elements of ordinary gradients (so that every crafted block
    is encoded inside the pipelined loop, and the tail is neither whole blocks nor whole vectors)."""

    TAIL = 2 * BLOCK + 37

    def __init__(self, algo):
        ys, ks = targets(True)
        g_m, k_m = blocks_of(torch.cat([ys, -ys]), 1.0, torch.cat([ks, ks]))
        self.m_blocks = g_m.numel() // BLOCK
        parts_g, parts_km, parts_kv = [g_m], [k_m], [torch.full_like(k_m, -1)]
        v_scales = []
        if algo == "adam":
            yv, kv = targets(False)
            g_v, heads = squares_hitting(yv)
            for head in heads.unique():
                sel = heads == head
                g_h, k_h = blocks_of(g_v[sel], head, kv[sel])
                parts_g.append(g_h)
                parts_km.append(torch.full_like(k_h, -1))
                parts_kv.append(k_h)
                v_scales += [head * head] * (g_h.numel() // BLOCK)
        self.v_scales = torch.stack(v_scales) if v_scales else torch.zeros(0)
        gen = torch.Generator().manual_seed(7)
        parts_g.append(torch.randn(self.TAIL, generator=gen) * torch.rand(self.TAIL, generator=gen).pow(4))
        parts_km.append(torch.full((self.TAIL,), -1))
        parts_kv.append(torch.full((self.TAIL,), -1))
        self.g, self.k_m, self.k_v = torch.cat(parts_g), torch.cat(parts_km), torch.cat(parts_kv)
        self.n = self.g.numel()
        self.crafted_blocks = (self.n - self.TAIL) // BLOCK

    def shuffled(self, seed):
        """The same values, permuted within each crafted block (the head moves, the 16-lane groups mix)."""
        gen = torch.Generator().manual_seed(seed)
        perm = torch.arange(self.n)
        for b in range(self.crafted_blocks):
            perm[b * BLOCK:(b + 1) * BLOCK] = b * BLOCK + torch.randperm(BLOCK, generator=gen)
        return self.g[perm], self.k_m[perm], self.k_v[perm]

    def assert_codes(self, st, m, k_m, k_v, what):
        """The scalar level's codes and scales of a crafted step with moments m (and v = m * m): the nearest
        magnitudes (ties toward zero) under the heads' scales."""
        sel = k_m >= 0
        assert torch.equal(st["exp_avg"][sel].long(), code_of(k_m[sel], m[sel] < 0, True)), what
        assert bool((st["exp_avg_scale"][:self.m_blocks] == 1.0).all()), what
        if "exp_avg_sq" in st:
            sel = k_v >= 0
            assert torch.equal(st["exp_avg_sq"][sel].long(), k_v[sel]), what
            assert torch.equal(st["exp_avg_sq_scale"][self.m_blocks:self.crafted_blocks], self.v_scales), what


@functools.lru_cache(maxsize=None)
def crafted(algo):
    """Crafted(algo), built once (its tensors are only read)."""
    return Crafted(algo)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("level", LEVELS)
def test_codes_on_and_around_every_midpoint(level, algo):
    c = crafted(algo)
    exact, _, ordinary = hypers(algo)
    g2, k_m2, k_v2 = c.shuffled(1)
    gen = torch.Generator().manual_seed(2)
    small = [torch.randn(c.n, generator=gen) * 1e-3 for _ in range(2)]
    steps = [
        (c.g, exact),                          # the targets in 16-lane groups of one kind
        (g2, exact),                           # mixed within groups, heads anywhere
        (-g2, exact),                          # negative m: heads (absmax) -1.0 take code 0
        (c.g, dict(exact, maximize=True)),     # m = -g
        (small[0], ordinary),                  # ordinary steps from the crafted state
        (small[1], dict(ordinary, maximize=True)),
    ]
    p0 = torch.randn(c.n, generator=torch.Generator().manual_seed(3))
    history = lockstep(algo, [("scalar", 1), (level, 1)], p0, zero_state(c.n, algo), steps)
    crafted_steps = [(c.g, c.k_m, c.k_v), (g2, k_m2, k_v2), (-g2, k_m2, k_v2), (-c.g, c.k_m, c.k_v)]
    for i, (m, k_m, k_v) in enumerate(crafted_steps):
        c.assert_codes(history[i][0], m, k_m, k_v, f"step {i + 1}")
    assert (history[0][0]["exp_avg"][0:c.m_blocks * BLOCK:BLOCK] == 255).all()  # the heads, 1.0
    minus_one = (-g2 == -1.0)[:c.m_blocks * BLOCK]  # the heads, and the targets 1.0: the map has no -1.0
    assert int(minus_one.sum()) > c.m_blocks
    assert (history[2][0]["exp_avg"][:c.m_blocks * BLOCK][minus_one] == 0).all()
    assert not torch.equal(history[4][0]["exp_avg"], history[3][0]["exp_avg"])


# ---- zeros, subnormals and blocks around FLT_MIN ---------------------------------------------------------------

def tiny_gradients():
    """Blocks (exact step: m = g, v = g * g) of +0, -0 and subnormals beside a head 1.0; of the signed targets
    under heads +-FLT_MIN and one float either side (the block below FLT_MIN is stored as zeros); under a head
    whose square is FLT_MIN or just below it (v's blocks); and of subnormals only. Then 2 ordinary blocks and 21
    elements. Returns the gradients and each kind's number of blocks."""
    ys, _ = targets(True)
    ys = torch.cat([ys, -ys])
    specials = f32([0.0, -0.0, 1.4e-45, -1.4e-45, 2.0 ** -140, -(2.0 ** -140), 1e-30, -1e-30])
    specials = torch.cat([specials, down(f32([FLT_MIN])), -down(f32([FLT_MIN])), f32([FLT_MIN, -FLT_MIN])])
    subnormals = torch.cat([specials[:6], specials[8:10]])
    half = 2.0 ** -63  # half * half = FLT_MIN
    below, above, half_below = float(down(f32(FLT_MIN))), float(up(f32(FLT_MIN))), float(down(f32(half)))
    blocks = [
        blocks_of(specials, 1.0),
        blocks_of(ys * FLT_MIN, FLT_MIN),        # scale exactly FLT_MIN; y rounded through the subnormals
        blocks_of(ys * FLT_MIN, -FLT_MIN),       # its absmax negative
        blocks_of(ys * below, below),            # absmax below FLT_MIN: zeros
        blocks_of(ys * above, above),
        blocks_of(ys * half, half),              # v's scale exactly FLT_MIN
        blocks_of(ys * half_below, half_below),  # v's absmax below FLT_MIN: zeros
        blocks_of(subnormals, 2.0 ** -130),      # subnormals only
    ]
    tail = torch.randn(2 * BLOCK + 21, generator=torch.Generator().manual_seed(11))
    return torch.cat(blocks + [tail]), [b.numel() // BLOCK for b in blocks]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("level", LEVELS)
def test_zeros_subnormals_and_blocks_around_flt_min(level, algo):
    g, sizes = tiny_gradients()
    n = g.numel()
    first = torch.tensor([0] + sizes).cumsum(0).tolist()  # each kind's first block
    exact, _, ordinary = hypers(algo)
    gen = torch.Generator().manual_seed(12)
    perm = torch.randperm(n, generator=gen)
    steps = [(g, exact), (g[perm], exact), (-g, exact), (torch.zeros(n), ordinary), (g, ordinary)]
    history = lockstep(algo, [("scalar", 1), (level, 1)], torch.randn(n, generator=gen), zero_state(n, algo), steps)
    for i, gi in enumerate([g, g[perm], -g]):  # the crafted steps encode as swapio.quant does
        assert_state(history[i][0], expected_state(algo, *exact_moments(algo, gi)), f"step {i + 1}")
    st = history[0][0]
    ms = st["exp_avg_scale"]
    assert ms[first[1]] == FLT_MIN and ms[first[2]] == FLT_MIN and ms[first[4]] == float(up(f32(FLT_MIN)))
    assert ms[first[3]] == 0 and ms[first[7]] == 0  # absmax below FLT_MIN
    assert st["exp_avg"][first[1] * BLOCK] == 255 and st["exp_avg"][first[2] * BLOCK] == 0  # the heads +-FLT_MIN
    assert history[2][0]["exp_avg"][first[1] * BLOCK] == 0
    assert len(st["exp_avg"][first[1] * BLOCK:first[2] * BLOCK].unique()) > 200  # the y really spread
    if algo == "adam":
        vs = st["exp_avg_sq_scale"]
        assert vs[first[5]] == FLT_MIN and vs[first[6]] == 0
        assert len(st["exp_avg_sq"][first[5] * BLOCK:first[6] * BLOCK].unique()) > 100
    # the ordinary step decays the FLT_MIN blocks below FLT_MIN: stored as zeros now
    assert history[3][0]["exp_avg_scale"][first[1]] == 0


# ---- near FLT_MAX: 1 / absmax subnormal, y above 1 -------------------------------------------------------------

def above_one(start, count):
    """Floats a >= start (> 2^126, where 1 / a is subnormal) whose y = a * fl(1 / a) is above 1."""
    cand = ulps(torch.full((1 << 16,), start), torch.arange(1 << 16, dtype=torch.int32))
    hit = cand[cand * (1 / cand) > 1.0]
    assert hit.numel() >= count
    return hit[:count]


def huge_state(algo):
    """int8 state whose halving (beta1 = beta2 = 0.5, g = 0) gives: every code under scale FLT_MAX (block 0);
    blocks whose absmax a, code 1.0 times the scale halved (1, 2) or -mags[127] times it (3), has a * fl(1 / a) > 1
    (so y > 1 at the absmax, for both maps and both signs); large scales (4, 5); and ordinary blocks, 2 of them and
    45 elements at the end."""
    gen = torch.Generator().manual_seed(21)
    n = 8 * BLOCK + 45
    nb = quant.num_blocks(n)
    m = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    v = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    ms = torch.rand(nb, generator=gen) * 1e-2
    vs = torch.rand(nb, generator=gen) * 1e-4
    m[:BLOCK] = torch.randperm(256, generator=gen).to(torch.uint8)
    v[:BLOCK] = torch.randperm(256, generator=gen).to(torch.uint8)
    ms[0] = vs[0] = FLT_MAX
    a = above_one(2.0 ** 126 * 1.1, 2)
    for b in (1, 2):
        blk = slice(b * BLOCK, (b + 1) * BLOCK)
        m[blk] = torch.randint(ZERO - 100, ZERO + 100, (BLOCK,), dtype=torch.uint8, generator=gen)
        v[blk] = torch.randint(0, 200, (BLOCK,), dtype=torch.uint8, generator=gen)
        m[blk][::37] = 255  # 1.0
        v[blk][::37] = 255
        ms[b] = vs[b] = 2 * a[b - 1]
    mag127 = -float(quant.code_values(True)[0])  # code 0 is -mags[127], the largest negative magnitude
    scales = ulps(torch.full((1 << 16,), 2 * 2.0 ** 126 * 1.3 / mag127), torch.arange(1 << 16, dtype=torch.int32))
    halves = (f32(mag127) * scales) * 0.5
    blk = slice(3 * BLOCK, 4 * BLOCK)
    m[blk] = torch.randint(ZERO - 100, ZERO + 100, (BLOCK,), dtype=torch.uint8, generator=gen)
    m[blk][5::41] = 0
    ms[3] = scales[halves * (1 / halves) > 1.0][0]
    ms[4], vs[4] = 1e38, 3e38
    ms[5] = vs[5] = 2.0 ** 127
    st = {"exp_avg": m, "exp_avg_scale": ms, "exp_avg_sq": v, "exp_avg_sq_scale": vs}
    return st if algo == "adam" else {k: st[k] for k in ("exp_avg", "exp_avg_scale")}


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("level", LEVELS)
def test_huge_moments_subnormal_inverse_scale_and_y_above_one(level, algo):
    st0 = huge_state(algo)
    n = st0["exp_avg"].numel()
    _, half, ordinary = hypers(algo)
    gen = torch.Generator().manual_seed(22)
    g = torch.randn(n, generator=gen) * 1e-3
    g[3::97] = float("nan")
    g[5::101] = 2e19  # finite, but g * g overflows (Adam: both moments dropped)
    g[7::103] = -float("inf")
    steps = [(torch.zeros(n), half), (g, half), (g.flip(0), ordinary), (torch.zeros(n), dict(ordinary, maximize=True))]
    history = lockstep(algo, [("scalar", 1), (level, 1)], torch.randn(n, generator=gen), st0, steps)
    # the first step halves the decoded state exactly: swapio.quant's encoding of that
    m_old = quant.dequantize(st0["exp_avg"], st0["exp_avg_scale"], True)
    v_old = quant.dequantize(st0["exp_avg_sq"], st0["exp_avg_sq_scale"], False) if algo == "adam" else None
    st = history[0][0]
    assert_state(st, expected_state(algo, m_old * 0.5, None if v_old is None else v_old * 0.5), "step 1")
    ms = st["exp_avg_scale"]
    assert bool((ms[:4] > 2.0 ** 126).all())  # 1 / scale is subnormal
    for b in (1, 2, 3):
        assert float(ms[b] * (1 / ms[b])) > 1.0  # the absmax's y is above 1
    for b in (1, 2):
        assert (st["exp_avg"][b * BLOCK:(b + 1) * BLOCK:37] == 255).all()
        if algo == "adam":
            assert float(st["exp_avg_sq_scale"][b] * (1 / st["exp_avg_sq_scale"][b])) > 1.0
            assert (st["exp_avg_sq"][b * BLOCK:(b + 1) * BLOCK:37] == 255).all()
    assert (st["exp_avg"][3 * BLOCK + 5:4 * BLOCK:41] == 0).all()
    assert history[1][1] > 0  # the non-finite ones were dropped (and counted)


# ---- lengths: tails, and the longer tiles on two threads --------------------------------------------------------

@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [1, 15, 17, 255, 257, 3 * BLOCK + 16, 5 * BLOCK + 23])
def test_short_and_ragged_lengths(level, algo, n):
    g = crafted(algo).g[:n]
    gen = torch.Generator().manual_seed(n)
    exact, _, ordinary = hypers(algo)
    steps = [(g, exact), (-g.flip(0), exact), (torch.randn(n, generator=gen) * 1e-3, ordinary)]
    history = lockstep(algo, [("scalar", 1), (level, 1)], torch.randn(n, generator=gen), zero_state(n, algo), steps)
    assert_state(history[0][0], expected_state(algo, *exact_moments(algo, g)), "step 1")
    assert_state(history[1][0], expected_state(algo, *exact_moments(algo, -g.flip(0))), "step 2")


def long_gradients(n, algo):
    """n elements: the crafted midpoint blocks repeated through the tensor between ordinary blocks of mixed
    magnitudes, with NaN, inf, g * g overflows, +-0 and subnormals, some beside the tiles' edges. k_m, k_v: the
    crafted elements' magnitude indices where their block is untouched by the specials (-1 elsewhere)."""
    c = crafted(algo)
    body = c.crafted_blocks * BLOCK
    gen = torch.Generator().manual_seed(31)
    g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4) * 1e-2
    k_m = torch.full((n,), -1)
    k_v = torch.full((n,), -1)
    for start in range(3 * BLOCK, n - body, body + 37 * BLOCK):
        g[start:start + body] = c.g[:body]
        k_m[start:start + body] = c.k_m[:body]
        k_v[start:start + body] = c.k_v[:body]
    edges = torch.arange(32 * 1024, n, 32 * 1024)  # every tile's edges, whatever the tile length
    specials = {float("nan"): 1001, float("inf"): 1003, -float("inf"): 1009, 3e38: 1013, -0.0: 1019, 0.0: 1021,
                1e-40: 1031, -1e-45: 1033}
    touched = torch.zeros(n, dtype=torch.bool)
    for value, stride in specials.items():
        for at in (torch.arange(stride, n, stride * 7), edges - 1 - stride % 5, edges + stride % 3):
            g[at] = value
            touched[at] = True
    # a special changes its block's absmax (or drops moments): that block's codes are no longer the targets'
    spoiled = torch.nn.functional.pad(touched, (0, quant.num_blocks(n) * BLOCK - n)).view(-1, BLOCK).any(1)
    spoiled = spoiled.repeat_interleave(BLOCK)[:n]
    k_m[spoiled] = -1
    k_v[spoiled] = -1
    return g, k_m, k_v


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [(1 << 20) + 4133, 600_001])
def test_long_tensors_on_several_threads(level, algo, n):
    """n > 1M: two threads take tiles of 4 x 32768 elements, three of 2 x (600_001: 2 x and 1 x), each tile with
    its own pipeline ends; one thread runs the tensor as one tile."""
    g, k_m, k_v = long_gradients(n, algo)
    exact, _, ordinary = hypers(algo)
    gen = torch.Generator().manual_seed(32)
    steps = [(g, exact), (torch.randn(n, generator=gen) * 1e-3, ordinary), (g.flip(0), ordinary)]
    configs = [("scalar", 1), ("scalar", 2), (level, 1), (level, 2), (level, 3)]
    history = lockstep(algo, configs, torch.randn(n, generator=gen), zero_state(n, algo), steps)
    st, count = history[0]
    assert count > 0  # the specials were there
    sel = k_m >= 0
    assert int(sel.sum()) > 10_000
    assert torch.equal(st["exp_avg"][sel].long(), code_of(k_m[sel], g[sel] < 0, True))
    if algo == "adam":
        sel = k_v >= 0
        assert int(sel.sum()) > 10_000
        assert torch.equal(st["exp_avg_sq"][sel].long(), k_v[sel])


# ---- found by this file: a negative second-moment scale ---------------------------------------------------------

@pytest.mark.parametrize("name", ["exp_avg_scale", "exp_avg_sq_scale"])
@pytest.mark.parametrize("bad", [-1.0, -0.0, -float("inf")], ids=str)
def test_a_negative_scale_is_refused_before_the_kernel_runs(name, bad):
    """A scale is a block's largest magnitude: no swapio code writes one below 0, but a caller of swapio.ops can pass
    one (or a damaged state file hold it). On such state the levels disagreed (AVX2 refitted a negative v as if it
    were not finite), so it is refused with a ValueError naming the tensor, and nothing is changed."""
    n = 3 * BLOCK
    st = {"exp_avg": torch.full((n,), ZERO, dtype=torch.uint8), "exp_avg_scale": torch.zeros(3),
          "exp_avg_sq": torch.full((n,), 255, dtype=torch.uint8), "exp_avg_sq_scale": torch.ones(3)}
    st[name][1] = bad
    before = {k: v.clone() for k, v in st.items()}
    p = torch.zeros(n)
    with pytest.raises(ValueError, match=name):
        ops.adam_step_(p, torch.zeros(n), st["exp_avg"], st["exp_avg_sq"], step=1,
                       exp_avg_scale=st["exp_avg_scale"], exp_avg_sq_scale=st["exp_avg_sq_scale"], **ADAM_HALF)
    assert torch.equal(p, torch.zeros(n))
    for k in st:
        assert torch.equal(st[k], before[k]) and torch.equal(torch.signbit(st[k].float()), torch.signbit(before[k].float()))
