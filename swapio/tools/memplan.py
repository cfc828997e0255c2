"""The memory arithmetic behind `swapio plan`, as pure functions (no I/O): bytes per parameter for
weights, gradients and optimizer state, and where they sit with and without swapio's optimizer offload.

Per parameter, with weights and gradients in `dtype`:
  weights, gradients   4 (fp32) or 2 (bf16/fp16) bytes each
  master weights       4 bytes when the weights are bf16/fp16 (swapio keeps an fp32 master); for fp32 0 where the
                       parameters are on the CPU (each is its own master), but 4 where they are on a GPU or
                       offloaded (swapio.offload): the optimizer steps an fp32 copy in RAM or on disk
                       (PerParam.placed; the "with a GPU" and "weights offloaded" layouts, *_gpu totals)
  moments              adam/adamw: 2 (exp_avg, exp_avg_sq); lion: 1 (exp_avg); each 4 bytes (fp32), 2 (bf16)
                       or 1 byte + one fp32 scale per 256 elements (int8); adafactor: 0 from a parameter count
                       alone (an LLM's matrices keep rows + cols fp32 numbers, well under 0.01 bytes a parameter;
                       fp32 state only)
So Adam on fp16 weights with fp32 master and moments is 2 + 2 + 4 + 8 = 16 bytes a parameter, 12 of them state.
From the parameters' shapes (plan(shapes=...), `swapio plan --shapes`) the moments are counted tensor by tensor,
as the optimizers allocate them: Adafactor factors the last two dimensions, so a tensor of two or more keeps
numel / shape[-1] + numel / shape[-2] fp32 numbers (a 1 x 1 convolution's [out, in, 1, 1] weight two an element,
8 bytes a parameter, as much as Adam's moments; a 3 x 3 one's 2/3 of one) and any other one numel; int8 state
rounds each tensor's scales up to whole blocks of 256 elements.
Activations (what autograd saves for backward) depend on the batch: counted only when the sequence length,
batch and model shape are given (activations()).
"""
import dataclasses
import math
import re

import torch

from ..kernels.quant import state_bytes_per_element
from ..optim.options import offloaded_batch_bytes
from ..optim.params import MASTER
from ..optim.rules import AdafactorRule, AdamRule, LionRule

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MOMENT_COUNT = {"adamw": 2, "adam": 2, "lion": 1, "adafactor": 0}  # adafactor: factored, counted as 0
STATE_BYTES = {name: state_bytes_per_element(name) for name in ("fp32", "bf16", "int8")}  # the kernels' own figures
DEFAULT_BUFFER_BYTES = 256 << 20  # OffloadAdamW's default pinned pipeline (nvme mode)
DEFAULT_BUFFER_COUNT = 4          # its slots
MASTER_BYTES = 4  # the fp32 master of a parameter that needs one
_RULES = {"adamw": AdamRule, "adam": AdamRule, "lion": LionRule, "adafactor": AdafactorRule}
WHOLE = {"adafactor"}  # optimizers that step each parameter whole: an nvme slot holds the largest one's record

_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE]\d+)?|\.\d+)\s*([kKmMbBgGtT]?)\s*")


def parse_count(text):
    """'7B', '70b', '1.5B', '125M', '7e9', '350000' -> a parameter count (decimal units); ValueError otherwise."""
    m = _COUNT_RE.fullmatch(str(text))
    if not m:
        raise ValueError(f"cannot parse {text!r} as a parameter count (a number with an optional K, M, B or T "
                         "suffix, e.g. 7B)")
    value = float(m.group(1)) * _COUNT_UNITS[m.group(2).upper()]
    if not math.isfinite(value):  # 1e400: float() gives inf, which round() cannot make an int
        raise ValueError(f"{text!r} is too large a parameter count")
    value = round(value)
    if value <= 0:
        raise ValueError(f"the parameter count must be positive, got {text!r}")
    return value


def _choice(name, value, table):
    if value not in table:
        raise ValueError(f"{name} must be one of {', '.join(table)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PerParam:
    """Bytes per parameter of each kind of memory."""
    weights: float
    grads: float
    master: float
    moments: float

    @property
    def state(self):
        return self.master + self.moments

    @property
    def total(self):
        return self.weights + self.grads + self.state

    @property
    def placed(self):
        """The same for parameters on a GPU or offloaded: the optimizer keeps an fp32 master of each of them
        (only a contiguous fp32 CPU parameter is its own; swapio.optim.params.needs_master)."""
        return dataclasses.replace(self, master=MASTER_BYTES)


def per_param(dtype="bf16", optimizer="adamw", state_dtype="fp32", shapes=None):
    """Bytes per parameter. shapes: the parameters' shapes, whose moments are then counted tensor by tensor
    (moment_bytes) and averaged; None: from the per-element figures (adafactor's moments counted as 0)."""
    w = WEIGHT_BYTES[_choice("dtype", dtype, WEIGHT_BYTES)]
    moments = MOMENT_COUNT[_choice("optimizer", optimizer, MOMENT_COUNT)]
    state = STATE_BYTES[_choice("state_dtype", state_dtype, STATE_BYTES)]
    if optimizer == "adafactor" and state_dtype != "fp32":
        raise ValueError(f"adafactor keeps fp32 state only (its factored moments are already next to nothing), "
                         f"got state_dtype {state_dtype!r}")
    per_moments = moments * state
    if shapes is not None:
        shapes = check_shapes(shapes)
        per_moments = moment_bytes(shapes, optimizer, state_dtype) / sum(math.prod(s) for s in shapes)
    return PerParam(weights=w, grads=w, master=0 if dtype == "fp32" else MASTER_BYTES, moments=per_moments)


def check_shapes(shapes):
    """The parameters' shapes as tuples of ints; ValueError for none, or for a shape that is not a sequence of
    positive whole numbers (a 0-element parameter keeps no state, and its shape is most likely a mistake)."""
    out = []
    for shape in shapes:
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise ValueError(f"a shape must be a sequence of dimensions, e.g. [4096, 4096], got {shape!r}")
        dims = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            raise ValueError(f"a shape's dimensions must be positive whole numbers, got {list(dims)}")
        out.append(dims)
    if not out:
        raise ValueError("no shapes given: at least one parameter's shape is needed")
    return out


def moment_bytes(shapes, optimizer="adamw", state_dtype="fp32"):
    """Bytes of the moments (int8's block scales included) an optimizer keeps for parameters of these shapes,
    counted by the optimizers' own rule and state format, so the plan is what they allocate: adafactor factors the
    last two dimensions of a tensor of two or more (numel / shape[-1] + numel / shape[-2] fp32 numbers), int8
    state adds one fp32 scale per started block of 256 elements of each tensor."""
    rule = _RULES[_choice("optimizer", optimizer, MOMENT_COUNT)](_choice("state_dtype", state_dtype, STATE_BYTES))
    fmt, total = rule.format, 0
    for shape in check_shapes(shapes):
        p = torch.empty(shape, device="meta")
        for name in rule.fields(p, {"amsgrad": False}):
            if name != MASTER:
                total += fmt.count(name, p.numel(), shape) * fmt.dtype(name).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the bytes sit for one way of training: GPU, host RAM and disk, in bytes. fits: for each place this
    way uses, whether the need fits the capacity given (None: capacity not given)."""
    name: str
    gpu: int
    ram: int
    disk: int
    fits: dict


def _fits(need, have):
    return None if have is None else need <= have


def state_pipeline(state_bytes, buffer_bytes, largest_record=0):
    """Pinned RAM of the nvme state pipeline: min(buffer_bytes, state), or, for an optimizer that never splits a
    parameter, each of its DEFAULT_BUFFER_COUNT slots the largest parameter's record where that is larger."""
    return max(min(buffer_bytes, state_bytes), DEFAULT_BUFFER_COUNT * largest_record)


def largest_record(optimizer, per, largest_module=0):
    """Bytes of the largest parameter's nvme record for an optimizer that steps whole parameters (its fp32 master;
    the largest module's own weights as the bound of its largest parameter), else 0."""
    return largest_module // per.weights * per.master if optimizer in WHOLE else 0


def offloaded_training_pinned(weight_bytes, state_bytes, buffer_bytes, ring_bytes, largest_module=0,
                              weight_itemsize=2, in_backward=False, record=0):
    """{part: bytes}: the most pinned host memory that training weights offloaded by disk_offload(buffer_bytes=
    ring_bytes) with an optimizer of offload="nvme" and `buffer_bytes` holds, part by part as
    memory_report()["pinned_parts"] states it (docs/offload.md, "Host memory"). largest_module: bytes of the
    largest module's own weights (an embedding, usually); 0 leaves out what depends on it. record: largest_record's."""
    batch = offloaded_batch_bytes(buffer_bytes)
    largest_grads = largest_module * 4 // weight_itemsize  # its fp32 gradients
    return {"weight_ring": min(ring_bytes, weight_bytes), "weight_spare": largest_module,
            "state": state_pipeline(state_bytes, buffer_bytes, record), "weight_pool": max(batch, largest_module),
            "grads": 0 if in_backward else 2 * max(batch, largest_grads)}


def offloaded_training_ram(weight_bytes, state_bytes, buffer_bytes, ring_bytes, largest_module=0,
                           weight_itemsize=2, in_backward=False, record=0):
    """Host memory of that training, not counting activations: the pinned parts, the largest module's gradient as
    autograd computes it (about twice its weights' bytes at the peak, measured on a Llama's embedding and head,
    before the gradient is summed), and with in_backward=True the fp32 gradients waiting for the update (two
    batches and one module's)."""
    pinned = offloaded_training_pinned(weight_bytes, state_bytes, buffer_bytes, ring_bytes, largest_module,
                                       weight_itemsize, in_backward, record)
    waiting = 2 * offloaded_batch_bytes(buffer_bytes) + largest_module * 4 // weight_itemsize if in_backward else 0
    return sum(pinned.values()) + 2 * largest_module + waiting


def layouts(params, per, gpu_mem=None, ram=None, disk_free=None, buffer_bytes=DEFAULT_BUFFER_BYTES, ring_bytes=None,
            largest_module=0, record=0):
    """The ways to train, in this order: with a GPU, torch's optimizer with its state on the GPU,
    OffloadAdamW(offload="cpu") with the state in RAM, OffloadAdamW(offload="nvme") with the state on disk and
    `buffer_bytes` of pinned RAM; then without a GPU (training on the CPU), OffloadAdamW(offload="cpu") with
    everything in RAM and OffloadAdamW(offload="nvme") with the weights and gradients in RAM, the state on disk;
    then the weights offloaded too (swapio.offload + a swapio optimizer), where the GPU, if any, holds
    a few modules at a time: cpu_offload with everything in RAM (fp32 gradient sums), and disk_offload with
    offload="nvme", weights, fp32 gradient sums and state on disk (or no gradient sums with in_backward=True),
    in RAM the budget of offloaded_training_ram: the weights' ring (`ring_bytes`, default buffer_bytes), the
    state pipeline, gradient buffers and the weight store's pool, each sized by buffer_bytes or by the largest
    module (`largest_module` bytes; 0: not counted); an optimizer stepping whole parameters pins at least
    DEFAULT_BUFFER_COUNT x `record` (largest_record of per.placed) for its state. Parameters on a GPU or offloaded
    keep an fp32 master whatever their dtype (per.placed), CPU ones only when not fp32 (per). Not counted:
    activations."""
    weights_and_grads = round(params * (per.weights + per.grads))
    state = round(params * per.state)  # CPU parameters (no GPU)
    placed = round(params * per.placed.state)  # parameters on a GPU or offloaded
    pipeline = state_pipeline(placed, buffer_bytes, record)
    cpu_pipeline = state_pipeline(state, buffer_bytes, record if per.master else 0)
    weights, grad_sums = round(params * per.weights), params * 4  # offloaded weights' gradients sum in fp32
    ring = buffer_bytes if ring_bytes is None else ring_bytes

    def offloaded_ram(in_backward):
        return offloaded_training_ram(weights, placed, buffer_bytes, ring, largest_module, per.weights, in_backward,
                                      record)
    ways = [("no offload (state on the GPU)", weights_and_grads + state, 0, 0),
            ('offload="cpu" (state in RAM)', weights_and_grads, placed, 0),
            ('offload="nvme" (state on disk)', weights_and_grads, pipeline, placed),
            ('no GPU, offload="cpu" (all in RAM)', 0, weights_and_grads + state, 0),
            ('no GPU, offload="nvme" (state on disk)', 0, weights_and_grads + cpu_pipeline, state),
            ('weights offloaded, "cpu" (all in RAM)', 0, weights + grad_sums + placed, 0),
            ('weights offloaded, "nvme" (all on disk)', 0, offloaded_ram(False), weights + grad_sums + placed),
            ('  the same, in_backward=True', 0, offloaded_ram(True), weights + placed)]
    have = {"gpu": gpu_mem, "ram": ram, "disk": disk_free}
    return [Layout(name, g, r, d, {k: _fits(need, have[k]) for k, need in (("gpu", g), ("ram", r), ("disk", d))
                                   if need})
            for name, g, r, d in ways]


def offloaded_step_seconds(weight_bytes, params, state_bytes, read_bytes_per_s, write_bytes_per_s,
                           in_backward=False):
    """A training step of offloaded weights and state (disk_offload + offload="nvme"): the weights are read in
    forward and again in backward and written once; the state read and written; with accumulation, the fp32
    gradient sums written in backward and read in step() (in_backward=True: never stored)."""
    grads = 0 if in_backward else params * 4
    read = 2 * weight_bytes + state_bytes + grads
    written = weight_bytes + state_bytes + grads
    return read / read_bytes_per_s + written / write_bytes_per_s


def nvme_step_seconds(state_bytes, read_bytes_per_s, write_bytes_per_s):
    """A step reads the whole state and writes it back; both share one disk, so the times add up. The Adam
    compute runs under the I/O (measured: step / max(I/O, compute) = 1.03 on the reference machine)."""
    return state_bytes / read_bytes_per_s + state_bytes / write_bytes_per_s


def plan(params=None, dtype="bf16", optimizer="adamw", state_dtype="fp32", gpu_mem=None, ram=None, disk_free=None,
         buffer_bytes=DEFAULT_BUFFER_BYTES, read_bytes_per_s=None, write_bytes_per_s=None, ring_bytes=None,
         largest_module=0, shapes=None):
    """Everything `swapio plan` prints, as a JSON-ready dict. shapes: the parameters' shapes (e.g.
    [tuple(p.shape) for p in model.parameters()]), whose moments are then counted as the optimizer allocates them
    (adafactor's factors of convolutions, int8's scales per tensor); params is then their element count, or None."""
    if shapes is not None:
        shapes = check_shapes(shapes)
        count = sum(math.prod(s) for s in shapes)
        if params is not None and params != count:
            raise ValueError(f"params ({params}) is not the element count of the shapes given ({count}): give one")
        params = count
    elif params is None:
        raise ValueError("give the parameter count (params) or the parameters' shapes (shapes)")
    per = per_param(dtype, optimizer, state_dtype, shapes)
    record = largest_record(optimizer, per.placed, largest_module)
    # *_gpu: parameters on a GPU or offloaded, which keep an fp32 master whatever their dtype
    totals = {"weights": round(params * per.weights), "grads": round(params * per.grads),
              "master": round(params * per.master), "moments": round(params * per.moments),
              "optimizer_state": round(params * per.state), "total": round(params * per.total),
              "optimizer_state_gpu": round(params * per.placed.state)}
    out = {"params": params, "dtype": dtype, "optimizer": optimizer, "state_dtype": state_dtype,
           "tensors": None if shapes is None else len(shapes),  # None: moments from the count alone
           "bytes_per_param": {"weights": per.weights, "grads": per.grads, "master": per.master,
                               "moments": per.moments, "optimizer_state": per.state, "total": per.total,
                               "optimizer_state_gpu": per.placed.state},
           "totals": totals,
           "capacity": {"gpu": gpu_mem, "ram": ram, "disk_free": disk_free},
           "buffer_bytes": buffer_bytes, "ring_bytes": buffer_bytes if ring_bytes is None else ring_bytes,
           "largest_module": largest_module,
           "offloaded_pinned": offloaded_training_pinned(
               totals["weights"], totals["optimizer_state_gpu"], buffer_bytes,
               buffer_bytes if ring_bytes is None else ring_bytes, largest_module, per.weights, record=record),
           "layouts": [dataclasses.asdict(x) for x in layouts(params, per, gpu_mem, ram, disk_free, buffer_bytes,
                                                               ring_bytes, largest_module, record)],
           "nvme_step_seconds": None, "offloaded_step_seconds": None}
    if read_bytes_per_s and write_bytes_per_s:
        out["offloaded_step_seconds"] = {
            mode: offloaded_step_seconds(totals["weights"], params, totals["optimizer_state_gpu"], read_bytes_per_s,
                                         write_bytes_per_s, in_backward=mode == "in_backward")
            for mode in ("accumulate", "in_backward")}
        out["nvme_step_seconds"] = nvme_step_seconds(totals["optimizer_state_gpu"], read_bytes_per_s,
                                                     write_bytes_per_s)
    return out


ACTIVATION_BYTES_PER_TOKEN_AND_WIDTH = 34  # a GPT-style layer with 16-bit activations, attention scores aside
ATTENTION_SCORE_BYTES = 5                  # per head, token and key: scores, softmax, dropout mask (no flash)


def activations(seq, batch, hidden, layers, heads=None, staging_bytes=256 << 20):
    """The bytes autograd saves in one forward of a GPT-style transformer with 16-bit activations (Korthikanti et
    al., "Reducing Activation Recomputation in Large Transformer Models", table 2): per layer
    seq x batch x hidden x 34, plus 5 x heads x seq^2 x batch for the attention scores when `heads` is given
    (eager attention; flash attention saves none of them). Where they sit with offload_activations: without it,
    all of them on the training device; to="cpu" all in pinned RAM, about two layers on the GPU; to="nvme" all
    on disk, staging_bytes + two layers in RAM."""
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("layers", layers)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    per_layer = seq * batch * hidden * ACTIVATION_BYTES_PER_TOKEN_AND_WIDTH
    if heads:
        per_layer += ATTENTION_SCORE_BYTES * heads * seq * seq * batch
    total = per_layer * layers
    return {"seq": seq, "batch": batch, "hidden": hidden, "layers": layers, "heads": heads,
            "per_layer": per_layer, "total": total,
            "offload_cpu": {"device": min(total, 2 * per_layer), "ram": total, "disk": 0},
            "offload_nvme": {"device": min(total, 2 * per_layer), "ram": min(total, staging_bytes + 2 * per_layer),
                             "disk": total}}
