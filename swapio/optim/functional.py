"""The functional core of the offloaded optimizers, in the manner of torch.optim's adamw().

`adam(...)` is one Adam/AdamW update of a flat slice of a parameter, given views of its state: the state
backends (cpu_state, nvme_state) walk wherever they keep the state and call it, slice by slice, through an
update rule. A rule is the small interface between an optimizer and the backends:

    rule.fields(p, group)     the state arrays kept for p, in storage order ("master" first when the
                              parameter needs an fp32 copy, see needs_master; then the moments; then, with
                              int8 state, one fp32 scale array per moment): what save() and load() carry
    rule.exported(p, group)   the arrays that state_dict() and save() carry, in that order: the moments (fp32
                              in state_dict, decoded; as stored in save), the master of bf16/fp16 parameters,
                              and with int8 state the scales, which make an export and re-import exact
    rule.STATE_KEYS           every exported name it may keep (what load_state_dict() reads from a state dict)
    rule.hyper(group)         keyword arguments for update(), validated (tensors become floats); the
                              optimizer calls it on its defaults at construction, so bad values raise there
    rule.update(param, grad, state, *, step, param_out, threads, seed, index_base, nonfinite, **hyper)
                              one step of a flat fp32 slice in place; state: {field: view of the slice}

How each array is stored (dtype, one element per parameter element or one per block) is the rule's
StateFormat (swapio.optim.state_format), chosen by the optimizer's state_dtype.

The backends know nothing of Adam: another update (Lion, one moment) or another state layout is another rule.
"""
from .. import ops
from .._hyper import check_adam_hyper, check_lion_hyper
from ._common import LOW_PRECISION, MASTER, needs_master, shard
from .state_format import StateFormat


def adam(param, grad, state, *, step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, param_out=None,
         threads=None, seed=0, index_base=0, nonfinite=None):
    """One Adam (adamw=False: L2 weight decay) or AdamW step of a flat fp32 slice, in place, with the CPU kernel.
    state: {"exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]} views of the slice (fp32, bf16, or int8 codes with
    "exp_avg_scale" and "exp_avg_sq_scale"); amsgrad when "max_exp_avg_sq" is there.
    param_out: None, or a bf16/fp16 slice that receives the updated parameter in the same pass.
    seed, index_base: the bf16 rounding's random bits (element i of the slice is element index_base + i of its
    parameter). nonfinite: None or an int64 counter of non-finite int8 moments stored as 0."""
    max_exp_avg_sq = state.get("max_exp_avg_sq")
    ops.adam_step_(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, maximize=maximize,
                   amsgrad=max_exp_avg_sq is not None, max_exp_avg_sq=max_exp_avg_sq, param_out=param_out,
                   threads=threads, exp_avg_scale=state.get("exp_avg_scale"),
                   exp_avg_sq_scale=state.get("exp_avg_sq_scale"), seed=seed, index_base=index_base,
                   nonfinite=nonfinite)


class _Rule:
    """What the rules share: the state arrays of a parameter follow from its moments and the state format."""

    MOMENTS = ()

    def __init__(self, state_dtype="fp32"):
        self.format = StateFormat(state_dtype)

    def moments(self, group):
        return self.MOMENTS

    def fields(self, p, group):
        moments = self.moments(group)
        return ((MASTER,) if needs_master(p) else ()) + moments + self.format.scales_of(moments)

    def exported(self, p, group):
        """The moments, the master only for bf16/fp16 parameters (for fp32 parameters the master equals the
        parameter bit for bit), and with int8 state the moments' block scales: re-quantising decoded moments
        alone could pick other scales (the signed map has no -1, so a block whose largest magnitude is negative
        decodes to 0.993 of its scale), while with the scales the codes are found again exactly."""
        moments = self.moments(group)
        return moments + ((MASTER,) if shard(p).dtype in LOW_PRECISION else ()) + self.format.scales_of(moments)


class AdamRule(_Rule):
    """Adam/AdamW: exp_avg, exp_avg_sq, and max_exp_avg_sq (fp32 state only) with amsgrad."""

    MOMENTS = ("exp_avg", "exp_avg_sq")
    STATE_KEYS = (MASTER, *MOMENTS, "max_exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")  # load_state_dict reads
    update = staticmethod(adam)

    def moments(self, group):
        return self.MOMENTS + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def hyper(self, group):
        if group["amsgrad"] and self.format.name != "fp32":
            raise ValueError(f"amsgrad needs state_dtype='fp32' (its running maximum of exp_avg_sq is kept "
                             f"exactly), got state_dtype={self.format.name!r}: use amsgrad=False with "
                             f"{self.format.name!r} state, or fp32 state with amsgrad")
        beta1, beta2 = betas_of(group)
        lr, beta1, beta2, eps, weight_decay = check_adam_hyper(group["lr"], beta1, beta2, group["eps"],
                                                               group["weight_decay"])
        return {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
                "adamw": bool(group["decoupled_weight_decay"]), "maximize": bool(group["maximize"])}


def betas_of(group):
    try:
        beta1, beta2 = group["betas"]
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {group['betas']!r}") from None
    return beta1, beta2


def lion(param, grad, state, *, step, lr, beta1, beta2, weight_decay, maximize, param_out=None, threads=None,
         seed=0, index_base=0, nonfinite=None):
    """One Lion step (Chen et al. 2023: sign of an interpolated momentum, decoupled weight decay) of a flat fp32
    slice, in place, with the CPU kernel. state: {"exp_avg"[, "exp_avg_scale"]}: views of the slice. The other
    arguments are adam()'s."""
    ops.lion_step_(param, grad, state["exp_avg"], step=step, lr=lr, beta1=beta1, beta2=beta2,
                   weight_decay=weight_decay, maximize=maximize, param_out=param_out, threads=threads,
                   exp_avg_scale=state.get("exp_avg_scale"), seed=seed, index_base=index_base, nonfinite=nonfinite)


class LionRule(_Rule):
    """Lion: one moment (exp_avg)."""

    MOMENTS = ("exp_avg",)
    STATE_KEYS = (MASTER, *MOMENTS, "exp_avg_scale")
    update = staticmethod(lion)

    def hyper(self, group):
        beta1, beta2 = betas_of(group)
        lr, beta1, beta2, weight_decay = check_lion_hyper(group["lr"], beta1, beta2, group["weight_decay"])
        return {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay,
                "maximize": bool(group["maximize"])}
