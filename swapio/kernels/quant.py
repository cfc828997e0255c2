"""Smaller optimizer state in plain torch: bf16 with stochastic rounding, and 8-bit block-wise dynamic-tree codes.

These are the references of the native kernels (``swapio.ops``) and what the optimizers use to convert state
(export to fp32 in ``state_dict()``, quantise an fp32 state dict on load). The kernels give the same bits.

int8 (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022; the scheme of bitsandbytes'
and torchao's 8-bit Adam): every block of ``BLOCK`` elements keeps its absolute maximum as an fp32 scale, and
every element the 8-bit code of its value divided by that scale. The 256 code values: 0, 1 and, per decade
10^-6 .. 10^0, evenly spaced means between 0.1 and 1 times the decade, more of them in the upper decades
(each within a few float32 ulps of that decimal formula: it is evaluated as one float32 multiply-add).
The signed map (first moments) has 127 values each side (+1 but no -1); the unsigned map (second moments,
never negative, so ``eps`` keeps its meaning) has 254 positive ones. Encoding picks the nearest code (ties
toward zero). A non-finite value is encoded as 0 and kept out of its block's scale, so one NaN or inf gradient
cannot wipe the other 255 elements of its block; a block whose absmax is below the smallest normal float is
stored as zeros. Adam's two moments of an element are dropped together (``drop_nonfinite_pairs``): a huge finite
gradient overflows g * g, and a finite exp_avg beside an exp_avg_sq stored as 0 would move the parameter by
exp_avg / eps at the next step (fp32 state keeps exp_avg_sq = inf there, and the update 0).

bf16 with stochastic rounding: 16 random bits are added below the kept ones before truncation, so a value
rounds up with a probability equal to the dropped fraction and the stored moment is unbiased. With
round-to-nearest, an update smaller than half a bf16 ulp (2^-9 relative) is lost every time: exp_avg_sq moves
by (1 - beta2) = 0.001 of its distance to g^2 per step with beta2 = 0.999, so it would stall. The random bits
of element i are a hash of (seed, step, i): deterministic, the same at every SIMD level and thread count, and
reproduced on resume.
"""
from typing import Optional, Tuple, Union

import torch

BLOCK = 256
_DECADES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
_FLT_MAX = torch.finfo(torch.float32).max
_FLT_MIN = torch.finfo(torch.float32).tiny
_M32 = 0xFFFFFFFF


def _f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def _magnitudes(signed):
    # Decade i's magnitudes decade * (0.1 + 0.9 * (j + 0.5) / parts), j < parts, are a line in the rank
    # r = parts + j: r * B + C. B and C are rounded to float32 once, r * B + C once (exact in double before
    # that, as in one FMA): the native kernel decodes with that FMA (csrc/adam/quant.cpp).
    mags = [0.0]
    for i, decade in enumerate(_DECADES):
        parts = (1 << i) if signed else (2 << i)
        b, c = _f32(0.9 * decade / parts), _f32(decade * (0.45 / parts - 0.8))
        mags += [r * b + c for r in range(parts, 2 * parts)]
    return torch.tensor(mags + [1.0], dtype=torch.float32)


class _Map:
    def __init__(self, signed):
        self.signed = signed
        self.mags = _magnitudes(signed)          # ascending, 0 .. 1
        self.max_k = len(self.mags) - 1          # 128 signed, 255 unsigned
        self.zero = self.max_k - 1 if signed else 0  # the code of 0
        self.max_neg_k = self.max_k - 1 if signed else 0
        self.mids = (self.mags[:-1] + self.mags[1:]) / 2
        neg = -self.mags[1:self.max_neg_k + 1].flip(0) if signed else self.mags[:0]
        self.codes = torch.cat([neg, self.mags])  # value of each code, ascending
        assert self.codes.numel() == 256


_MAPS = {True: _Map(True), False: _Map(False)}


def code_values(signed: bool) -> torch.Tensor:
    """The 256 code values, ascending (signed: first moments; unsigned: second moments)."""
    return _MAPS[bool(signed)].codes.clone()


def num_blocks(n: int) -> int:
    """Blocks of BLOCK elements (each with one fp32 scale) that hold n elements."""
    return -(-n // BLOCK)


def _blocks(x):
    flat = x.reshape(-1).float()
    pad = num_blocks(flat.numel()) * BLOCK - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def quantize(x: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of x's numel, scales fp32 of one per BLOCK) of a tensor's values."""
    q = _MAPS[bool(signed)]
    n = x.numel()
    xb = _blocks(x)
    ax = xb.abs()
    finite = ax <= _FLT_MAX
    absmax = torch.where(finite, ax, 0.0).amax(dim=1) if n else torch.zeros(0)
    scale = torch.where(absmax >= _FLT_MIN, absmax, 0.0)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
    y = torch.where(finite, ax * inv[:, None], 0.0).clamp_(max=1.0)
    k = torch.bucketize(y, q.mids)
    if signed:
        code = torch.where(xb < 0, q.zero - k.clamp(max=q.max_neg_k), q.zero + k)
    else:
        code = q.zero + k
    return code.to(torch.uint8).reshape(-1)[:n].clone(), scale


def drop_nonfinite_pairs(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """Sets both moments of every element where either is NaN or infinite to 0, in place (before quantize())."""
    bad = ~(exp_avg.isfinite() & exp_avg_sq.isfinite())
    exp_avg.masked_fill_(bad, 0.0)
    exp_avg_sq.masked_fill_(bad, 0.0)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 values of codes (uint8, n) with scales (fp32, one per BLOCK): code value * block scale. ValueError for
    other codes or another count of scales (int8 codes indexed the table from its end, one scale was broadcast
    over every block: other values, silently)."""
    n = codes.numel()
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8 (what quantize() gives), got {codes.dtype}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != num_blocks(n):
        got = f"{scale.numel()}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale must hold one scale per {BLOCK} codes ({num_blocks(n)} for {n} codes), got {got}")
    values = _MAPS[bool(signed)].codes[codes.reshape(-1).long()]
    full = torch.nn.functional.pad(values, (0, num_blocks(n) * BLOCK - n)).view(-1, BLOCK)
    res = (full * scale.reshape(-1, 1)).reshape(-1)[:n]
    if out is None:
        return res
    return out.reshape(-1).copy_(res)


def _mul32(x, c):
    """(x * c) mod 2^32 for int64 tensors x < 2^32 and a constant c < 2^32, without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x):
    """MurmurHash3's 32-bit finalizer on int64 tensors (or Python ints) holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B) if isinstance(x, torch.Tensor) else (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35) if isinstance(x, torch.Tensor) else (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def sr_key(seed: int, step: Union[int, torch.Tensor]) -> int:
    """The per-step key of the stochastic-rounding hash: (seed, step) mixed into 32 bits."""
    k = _fmix32(seed & _M32)
    k = _fmix32(k ^ ((seed >> 32) & _M32))
    return _fmix32(k ^ (int(step) & _M32))


def sr_bits(seed: int, step: Union[int, torch.Tensor], index_base: int, n: int) -> torch.Tensor:
    """The 32 random bits of elements index_base .. index_base + n - 1 (int64 tensor): the first moment
    rounds with the low 16, the second with the high 16."""
    idx = (torch.arange(n, dtype=torch.int64) + index_base) & _M32
    return _fmix32((sr_key(seed, step) + _mul32(idx, 0x9E3779B9)) & _M32)


def round_bf16_stochastic(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 x, rounded up with probability equal to the fraction dropped (random16: int64, 0..65535
    per element). NaN becomes 0xFFFF like the kernels' conversions."""
    bits = x.reshape(-1).view(torch.int32).to(torch.int64) & _M32
    r = ((bits + random16) >> 16) & 0xFFFF
    r = torch.where(x.reshape(-1).isnan(), 0xFFFF, r)
    return r.to(torch.int32).to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def state_bytes_per_element(state_dtype: str) -> float:
    """Bytes one moment element takes in RAM or on disk (int8 includes its share of the block scale)."""
    sizes = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / BLOCK}
    if not isinstance(state_dtype, str) or state_dtype not in sizes:  # (a KeyError)
        raise ValueError(f"state_dtype must be one of {list(sizes)}, got {state_dtype!r}")
    return sizes[state_dtype]

