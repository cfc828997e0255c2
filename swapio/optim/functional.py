"""The functional layer of the offloaded optimizers, in the manner of torch.optim's adam()/adamw().

`adam(...)` and `lion(...)` are one update of a flat slice of a parameter, given views of its state
({field: view}). Like torch.optim's adam(), which picks _single_tensor_adam, _multi_tensor_adam or _fused_adam
behind one signature, each picks an implementation behind one signature:
  "native"     swapio.ops.adam_step_ / lion_step_: the fused CPU kernel (AVX-512 / AVX2 / scalar), CPU tensors;
  "reference"  swapio.ops.adam_step_reference_ / lion_step_reference_: the same step in plain torch ops, on any
               device (what the kernel is tested against).
kernel=None picks the native kernel when the slice is on the CPU, else the reference. The state backends
(cpu_state, nvme_state) always hand CPU slices, so the optimizers step with the native kernel; the reference
is there for slices that live elsewhere (a state kept on an accelerator, tests).

The update rules (swapio.optim.rules) bind these to an optimizer's state fields and hyperparameters.
"""
import math

from ..kernels import ops

KERNELS = ("native", "reference")


def _kernel(kernel, *tensors):
    if kernel is None:
        return "native" if all(t is None or t.device.type == "cpu" for t in tensors) else "reference"
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {list(KERNELS)} or None, got {kernel!r}")
    return kernel


def adam(param, grad, state, *, shape=None, step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, param_out=None,
         threads=None, seed=0, index_base=0, nonfinite=None, kernel=None):
    """One Adam (adamw=False: L2 weight decay) or AdamW step of a flat fp32 slice, in place.
    state: {"exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]} views of the slice (fp32, bf16, or int8 codes with
    "exp_avg_scale" and "exp_avg_sq_scale"); amsgrad when "max_exp_avg_sq" is there.
    param_out: None, or a bf16/fp16 slice that receives the updated parameter in the same pass.
    seed, index_base: the bf16 rounding's random bits (element i of the slice is element index_base + i of its
    parameter). nonfinite: None or an int64 counter of non-finite int8 moments stored as 0.
    shape: the parameter's (unused: Adam is element-wise). kernel: "native", "reference" or None (see the
    module)."""
    # Looked up at each call (not bound at import), so that a wrapper installed on swapio.ops is the one run.
    step_ = ops.adam_step_ if _kernel(kernel, param, grad) == "native" else ops.adam_step_reference_
    max_exp_avg_sq = state.get("max_exp_avg_sq")
    step_(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
          weight_decay=weight_decay, adamw=adamw, maximize=maximize, amsgrad=max_exp_avg_sq is not None,
          max_exp_avg_sq=max_exp_avg_sq, param_out=param_out, threads=threads,
          exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"), seed=seed,
          index_base=index_base, nonfinite=nonfinite)


def lion(param, grad, state, *, shape=None, step, lr, beta1, beta2, weight_decay, maximize, param_out=None,
         threads=None, seed=0, index_base=0, nonfinite=None, kernel=None):
    """One Lion step (Chen et al. 2023: sign of an interpolated momentum, decoupled weight decay) of a flat fp32
    slice, in place. state: {"exp_avg"[, "exp_avg_scale"]}: views of the slice. The other arguments are
    adam()'s."""
    step_ = ops.lion_step_ if _kernel(kernel, param, grad) == "native" else ops.lion_step_reference_
    step_(param, grad, state["exp_avg"], step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
          maximize=maximize, param_out=param_out, threads=threads, exp_avg_scale=state.get("exp_avg_scale"),
          seed=seed, index_base=index_base, nonfinite=nonfinite)


def adafactor(param, grad, state, *, shape, step, lr, beta2_decay, eps1, eps2, d, weight_decay, maximize,
              param_out=None, threads=None, seed=0, index_base=0, nonfinite=None, kernel=None):
    """One Adafactor step (torch.optim.Adafactor's algorithm) of a whole parameter of `shape`, flat fp32, in
    place. state: {"row_var", "col_var"} (two or more dimensions) or {"variance"}: flat views. The step needs the
    whole parameter (AdafactorRule.whole): index_base is always 0. seed and nonfinite are unused (fp32 state)."""
    if index_base != 0 or param.numel() != math.prod(tuple(shape)):
        raise ValueError(f"adafactor steps whole parameters: got elements from {index_base} of {param.numel()} "
                         f"for a parameter of shape {tuple(shape)}")
    step_ = ops.adafactor_step_ if _kernel(kernel, param, grad) == "native" else ops.adafactor_step_reference_
    step_(param, grad, shape=shape, row_var=state.get("row_var"), col_var=state.get("col_var"),
          variance=state.get("variance"), step=step, lr=lr, beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d,
          weight_decay=weight_decay, maximize=maximize, param_out=param_out, threads=threads)
