"""The functional core of the offloaded optimizers, in the manner of torch.optim's adamw().

`adam(...)` is one Adam/AdamW update of a flat slice of a parameter, given views of its state: the state
backends (cpu_state, nvme_state) walk wherever they keep the state and call it, slice by slice, through an
update rule. A rule is the small interface between an optimizer and the backends:

    rule.fields(p, group)     the per-element state arrays kept for p, in storage order ("master" first when
                              the parameter needs an fp32 copy; see needs_master)
    rule.exported(p, group)   those that state_dict() and save() carry, in that order
    rule.STATE_KEYS           every field name it may keep (what load_state_dict() reads from a state dict)
    rule.hyper(group)         keyword arguments for update(), validated (tensors become floats); the
                              optimizer calls it on its defaults at construction, so bad values raise there
    rule.update(param, grad, state, *, step, param_out, threads, **hyper)
                              one step of a flat fp32 slice in place; state: {field: fp32 view of the slice}

The backends know nothing of Adam: another update (Lion, one moment) or another state layout is another rule.
"""
from .. import ops
from .._hyper import check_adam_hyper, check_lion_hyper
from ._common import LOW_PRECISION, MASTER, needs_master


def adam(param, grad, state, *, step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, param_out=None,
         threads=None):
    """One Adam (adamw=False: L2 weight decay) or AdamW step of a flat fp32 slice, in place, with the CPU kernel.
    state: {"exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]} fp32 views of the slice; amsgrad when the last is there.
    param_out: None, or a bf16/fp16 slice that receives the updated parameter in the same pass."""
    max_exp_avg_sq = state.get("max_exp_avg_sq")
    ops.adam_step_(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, maximize=maximize,
                   amsgrad=max_exp_avg_sq is not None, max_exp_avg_sq=max_exp_avg_sq, param_out=param_out,
                   threads=threads)


class AdamRule:
    """Adam/AdamW over fp32 moments (exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad)."""

    MOMENTS = ("exp_avg", "exp_avg_sq")
    STATE_KEYS = (MASTER, *MOMENTS, "max_exp_avg_sq")  # every field it may keep: what load_state_dict reads
    update = staticmethod(adam)

    def fields(self, p, group):
        fields = (MASTER,) if needs_master(p) else ()
        return fields + self.MOMENTS + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def exported(self, p, group):
        """The moments, max_exp_avg_sq with amsgrad, and the master only for bf16/fp16 parameters (for fp32
        parameters the master equals the parameter bit for bit)."""
        return (self.MOMENTS + (("max_exp_avg_sq",) if group["amsgrad"] else ())
                + ((MASTER,) if p.dtype in LOW_PRECISION else ()))

    def hyper(self, group):
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


def lion(param, grad, state, *, step, lr, beta1, beta2, weight_decay, maximize, param_out=None, threads=None):
    """One Lion step (Chen et al. 2023: sign of an interpolated momentum, decoupled weight decay) of a flat fp32
    slice, in place, with the CPU kernel. state: {"exp_avg"}: an fp32 view of the slice."""
    ops.lion_step_(param, grad, state["exp_avg"], step=step, lr=lr, beta1=beta1, beta2=beta2,
                   weight_decay=weight_decay, maximize=maximize, param_out=param_out, threads=threads)


class LionRule:
    """Lion over one fp32 moment (exp_avg)."""

    MOMENTS = ("exp_avg",)
    STATE_KEYS = (MASTER, *MOMENTS)
    update = staticmethod(lion)

    def fields(self, p, group):
        return ((MASTER,) if needs_master(p) else ()) + self.MOMENTS

    def exported(self, p, group):
        return self.MOMENTS + ((MASTER,) if p.dtype in LOW_PRECISION else ())

    def hyper(self, group):
        beta1, beta2 = betas_of(group)
        lr, beta1, beta2, weight_decay = check_lion_hyper(group["lr"], beta1, beta2, group["weight_decay"])
        return {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay,
                "maximize": bool(group["maximize"])}
