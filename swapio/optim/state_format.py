"""How an offloaded optimizer stores its state arrays: state_dtype "fp32", "bf16" or "int8".

The fp32 master copy stays fp32 in every format; the moments are stored as
  fp32   4 bytes an element;
  bf16   2 bytes, written by the kernels with stochastic rounding (swapio.quant explains why);
  int8   1 byte of block-wise dynamic-tree code (swapio.quant) plus one fp32 scale per block of 256 elements,
         kept in a companion array "<moment>_scale".
A scale belongs to a block of 256 elements of the parameter, so every slice of a parameter that the backends
hand to the kernel starts on a block boundary (`align`) and a slice's scales are the blocks it covers.

state_dict() carries fp32 moments (torch.optim.AdamW loads them): decode() turns stored arrays into fp32,
encode() stores fp32 values (round to nearest for bf16, quantised for int8), e.g. an fp32 state dict loaded into
an int8 optimizer. save()/load() carry the stored arrays as they are, so a resumed run is bit-identical.

Factored second moments (Adafactor's "row_var" and "col_var", FACTORS) are shaped by the parameter, not by its
element count: the parameter's shape with its last (row_var) or second-to-last (col_var) dimension 1, fp32. A
rule that keeps them steps whole parameters (Rule.whole), so the backends hand out a parameter in one piece
[0, numel) and a piece of such a field is the whole array.
"""
import math

import torch

from ..kernels import quant
from .params import FP32, MASTER, shard

STATE_DTYPES = ("fp32", "bf16", "int8")
SCALE = "_scale"
_MOMENT_DTYPE = {"fp32": FP32, "bf16": torch.bfloat16, "int8": torch.uint8}
_UNSIGNED = ("exp_avg_sq", "max_exp_avg_sq", "variance")  # never negative: the unsigned int8 map
FACTORS = {"row_var": -1, "col_var": -2}  # factored second moment -> the parameter's dimension reduced to 1


def factor_shape(name, shape):
    """The shape of factor `name` of a parameter of `shape` (two or more dimensions)."""
    shape = list(shape)
    shape[FACTORS[name]] = 1
    return tuple(shape)


def shape_of_factors(row_shape, col_shape):
    """The parameter's shape from the shapes of its row_var and col_var."""
    return tuple(row_shape[:-1]) + (col_shape[-1],)


def check_state_dtype(state_dtype):
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    return state_dtype


class StateFormat:
    """How the state arrays are stored, and what that means to the callers, by name: the optimizer asks
    `counts_nonfinite`, the rules `supports_amsgrad` and `scales_of`, the backends and checkpoints `dtype`,
    `count` and `part`, state dicts `exports_stored` and `decode`/`encode`, memory plans `bytes_per_element`.
    Nothing outside this class branches on the format's name."""

    def __init__(self, state_dtype="fp32"):
        self.name = check_state_dtype(state_dtype)
        self.moment_dtype = _MOMENT_DTYPE[state_dtype]
        # Pieces of a parameter start at a multiple of this in every format, so that a checkpoint of one format
        # can be read piece by piece into another.
        self.align = quant.BLOCK

    def __eq__(self, other):
        return isinstance(other, StateFormat) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"StateFormat({self.name!r})"

    @property
    def has_scales(self):
        """Each moment comes with an fp32 array of block scales ("<moment>_scale")."""
        return self.moment_dtype == torch.uint8

    @property
    def counts_nonfinite(self):
        """Non-finite new moments are stored as 0 (and counted, so that the step can warn): int8 codes have no
        NaN or inf, and one would spoil its whole block's scale."""
        return self.has_scales

    @property
    def supports_amsgrad(self):
        """amsgrad's running maximum of exp_avg_sq is kept exactly, so only in fp32 state."""
        return self.moment_dtype == FP32

    @property
    def exports_stored(self):
        """The stored moments are already what state_dict() exports (fp32): it may hand out the live tensors."""
        return self.moment_dtype == FP32

    @property
    def bytes_per_element(self):
        """Bytes one moment element takes in RAM or on disk (int8 includes its share of the block scale)."""
        return quant.state_bytes_per_element(self.name)

    def scales_of(self, moments):
        return tuple(m + SCALE for m in moments) if self.has_scales else ()

    @staticmethod
    def is_scale(name):
        return name.endswith(SCALE)

    @staticmethod
    def is_factor(name):
        """A factored second moment: its size follows the parameter's shape, and pieces of it are whole."""
        return name in FACTORS

    def dtype(self, name):
        """The dtype an array is stored in."""
        if name == MASTER or self.is_scale(name) or name == "max_exp_avg_sq" or self.is_factor(name):
            return FP32
        return self.moment_dtype

    def count(self, name, n, shape=None):
        """Stored elements of `name` for n parameter elements; a factor needs the parameter's shape (its pieces
        are whole parameters)."""
        if self.is_factor(name):
            return math.prod(factor_shape(name, shape))
        return quant.num_blocks(n) if self.is_scale(name) else n

    def shape(self, name, shape):
        """The shape of the array of `name` for a whole parameter of `shape` (flat scales)."""
        if self.is_factor(name):
            return factor_shape(name, shape)
        return (self.count(name, math.prod(shape)),) if self.is_scale(name) else tuple(shape)

    def first(self, name, a):
        """The stored element that holds parameter element a (a block boundary for a scale; 0 for a factor,
        whose pieces start at 0)."""
        if self.is_factor(name):
            return 0
        return a // quant.BLOCK if self.is_scale(name) else a

    def part(self, name, view, a, b):
        """The elements of a field's flat view that belong to parameter elements [a, b) of that view (a factor's
        piece is the parameter whole: its whole view)."""
        if self.is_factor(name):
            return view
        first = self.first(name, a)
        return view[first:first + self.count(name, b - a)]

    def empty(self, name, p, dtype=None):
        """A new array for the whole of parameter p (shaped like p, but flat scales and shaped factors), of the
        stored dtype."""
        return torch.empty(self.shape(name, shard(p).shape), dtype=dtype or self.dtype(name))

    def decode(self, views, name):
        """fp32 values of an exported field from the stored views of one slice ({field: view})."""
        view = views[name]
        if view.dtype == torch.uint8:
            return quant.dequantize(view, views[name + SCALE], signed=name not in _UNSIGNED)
        return view.float()  # the view itself when it is fp32

    def encode_fields(self, views, values, scales=None):
        """Stores fp32 values of several exported fields ({name: values}) into the views of one slice. int8 drops
        both moments of an element where either is not finite (swapio.quant.drop_nonfinite_pairs), as the kernels
        do: a loaded exp_avg_sq of inf beside a finite exp_avg would otherwise be stored as 0 beside it.
        scales: {name: the block scales the values were decoded with} where known (see encode)."""
        if self.counts_nonfinite and "exp_avg" in values and "exp_avg_sq" in values:
            m, v = values["exp_avg"].float().clone(), values["exp_avg_sq"].float().clone()
            quant.drop_nonfinite_pairs(m, v)
            values = {**values, "exp_avg": m, "exp_avg_sq": v}
        scales = scales or {}
        for name, x in values.items():
            self.encode(views, name, x, scales.get(name))

    def encode(self, views, name, values, scale=None):
        """Stores fp32 values of an exported field into the views of one slice. scale: None, or the block scales
        the values were decoded with (state_dict() exports them): where the values are exactly codes times
        those scales, those codes and scales are stored, so an export and re-import is exact; else (values
        changed, or from an fp32 state) they are quantised afresh."""
        view = views[name]
        if view.dtype == torch.uint8:
            signed = name not in _UNSIGNED
            codes = None if scale is None else _codes_at(values, scale, signed)
            if codes is None:
                codes, scale = quant.quantize(values, signed=signed)
            view.copy_(codes)
            views[name + SCALE].copy_(scale)
        else:
            view.copy_(values.reshape(-1))


def _codes_at(values, scale, signed):
    """The codes that decode to exactly `values` with block scales `scale`, or None if there are none."""
    table = quant.code_values(signed)  # ascending; a code is its index
    n = values.numel()
    scale = scale.reshape(-1).float()
    if scale.numel() != quant.num_blocks(n) or not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        return None
    pad = quant.num_blocks(n) * quant.BLOCK - n
    blocks = torch.nn.functional.pad(values.reshape(-1).float(), (0, pad)).view(-1, quant.BLOCK)
    s = scale[:, None]
    y = torch.where(s > 0, blocks / torch.where(s > 0, s, 1.0), 0.0)
    codes = torch.bucketize(y, (table[:-1] + table[1:]) / 2).clamp_(0, 255).to(torch.uint8).reshape(-1)[:n]
    if not torch.equal(quant.dequantize(codes, scale, signed), values.reshape(-1).float()):
        return None
    return codes
