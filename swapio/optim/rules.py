"""Update rules: what an optimizer of the family keeps and how it steps, the small interface between an
optimizer class and the state backends.

    rule.format               the StateFormat (swapio.optim.state_format) chosen by state_dtype
    rule.fields(p, group)     the state arrays kept for p, in storage order ("master" first when the
                              parameter needs an fp32 copy, see params.needs_master; then the moments; then,
                              with int8 state, one fp32 scale array per moment): what save() and load() carry
    rule.exported(p, group)   the arrays that state_dict() and save() carry, in that order: the moments (fp32
                              in state_dict, decoded; as stored in save), the master of bf16/fp16 parameters,
                              and with int8 state the scales, which make an export and re-import exact
    rule.STATE_KEYS           every exported name it may keep (what load_state_dict() reads from a state dict)
    rule.hyper(group)         keyword arguments for update(), validated (tensors become floats); the
                              optimizer calls it on its defaults at construction, so bad values raise there
    rule.update(param, grad, state, *, shape, step, param_out, threads, seed, index_base, nonfinite, **hyper)
                              one step of a flat fp32 slice in place (swapio.optim.functional); shape: the
                              parameter's
    rule.whole                True when the update needs the whole parameter at once (reductions over rows,
                              columns or all of it: Adafactor); the backends then never split a parameter,
                              and hand it to update() in one piece [0, numel). False: any slice on the
                              state format's `align` may be stepped alone (Adam, Lion)

The backends know nothing of Adam: another update (Lion, one moment) or another state layout is another rule.
"""
from ..kernels._hyper import check_adafactor_hyper, check_adam_hyper, check_lion_hyper, pair
from .functional import adafactor, adam, lion
from .params import LOW_PRECISION, MASTER, needs_master, shard
from .state_format import StateFormat
from .transformers_adafactor import refuse_lr_none, refuse_transformers_args


class Rule:
    """What the rules share: the state arrays of a parameter follow from its moments and the state format."""

    MOMENTS = ()
    STATE_KEYS = (MASTER,)
    whole = False

    def __init__(self, state_dtype="fp32"):
        self.format = StateFormat(state_dtype)  # ValueError for an unknown state_dtype

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
        master = shard(p).dtype in LOW_PRECISION or shard(p).is_meta  # meta: an offloaded weight's placeholder
        return moments + ((MASTER,) if master else ()) + self.format.scales_of(moments)

    def hyper(self, group):
        """The kernel's hyperparameters of `group`, checked (TypeError/ValueError)."""
        if group.get("differentiable"):
            # torch's differentiable=True steps under autograd, so a meta-learning loop gets gradients through the
            # update; a state dict of such a torch optimizer loaded here would step without them, silently
            raise ValueError("differentiable=True (a step that autograd records) is not supported: swapio steps "
                             "with its fused CPU kernel outside autograd; use torch.optim for a differentiable step")
        return self._hyper(group)

    def _hyper(self, group):
        raise NotImplementedError

    def options(self, group):
        """hyper(group) and the options that decide what state an update keeps (amsgrad): what an update run
        before step() (in_backward) used, which step() compares with the group's options then."""
        return self.hyper(group)


class AdamRule(Rule):
    """Adam/AdamW: exp_avg, exp_avg_sq, and max_exp_avg_sq (fp32 state only) with amsgrad."""

    MOMENTS = ("exp_avg", "exp_avg_sq")
    STATE_KEYS = (MASTER, *MOMENTS, "max_exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")  # load_state_dict reads
    update = staticmethod(adam)

    def moments(self, group):
        return self.MOMENTS + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def options(self, group):
        return {**self.hyper(group), "amsgrad": bool(group["amsgrad"])}

    def _hyper(self, group):
        if group["amsgrad"] and not self.format.supports_amsgrad:
            raise ValueError(f"amsgrad needs state_dtype='fp32' (its running maximum of exp_avg_sq is kept "
                             f"exactly), got state_dtype={self.format.name!r}: use amsgrad=False with "
                             f"{self.format.name!r} state, or fp32 state with amsgrad")
        beta1, beta2 = betas_of(group)
        lr, beta1, beta2, eps, weight_decay = check_adam_hyper(group["lr"], beta1, beta2, group["eps"],
                                                               group["weight_decay"])
        return {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
                "adamw": bool(group["decoupled_weight_decay"]), "maximize": bool(group["maximize"])}


class LionRule(Rule):
    """Lion: one moment (exp_avg)."""

    MOMENTS = ("exp_avg",)
    STATE_KEYS = (MASTER, *MOMENTS, "exp_avg_scale")
    update = staticmethod(lion)

    def _hyper(self, group):
        beta1, beta2 = betas_of(group)
        lr, beta1, beta2, weight_decay = check_lion_hyper(group["lr"], beta1, beta2, group["weight_decay"])
        return {"lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": weight_decay,
                "maximize": bool(group["maximize"])}


class AdafactorRule(Rule):
    """Adafactor (torch.optim.Adafactor): the second moment of a parameter of two or more dimensions factored
    over its last two ("row_var", "col_var": O(rows + cols)), of one of fewer dimensions kept whole ("variance");
    no first moment. The update needs the whole parameter (its norm, row and column means, the update's norm):
    whole. fp32 state only (the factors are already a vanishing fraction of the parameter)."""

    FACTORED = ("row_var", "col_var")
    VECTOR = ("variance",)
    STATE_KEYS = (MASTER, *FACTORED, *VECTOR)
    whole = True
    update = staticmethod(adafactor)

    def __init__(self, state_dtype="fp32"):
        super().__init__(state_dtype)
        if self.format.name != "fp32":
            raise ValueError(f"OffloadAdafactor keeps fp32 state only (its factored second moments take "
                             f"O(rows + cols) per matrix already), got state_dtype={state_dtype!r}")

    def moments_of(self, p):
        return self.FACTORED if shard(p).dim() > 1 else self.VECTOR

    def fields(self, p, group):
        return ((MASTER,) if needs_master(p) else ()) + self.moments_of(p)

    def exported(self, p, group):
        master = shard(p).dtype in LOW_PRECISION or shard(p).is_meta
        return self.moments_of(p) + ((MASTER,) if master else ())

    def _hyper(self, group):
        refuse_transformers_args(group)  # torch would keep them in the group unread
        refuse_lr_none(group["lr"])
        lr, beta2_decay, eps1, eps2, d, weight_decay = check_adafactor_hyper(
            group["lr"], group["beta2_decay"], group["eps"], group["d"], group["weight_decay"])
        return {"lr": lr, "beta2_decay": beta2_decay, "eps1": eps1, "eps2": eps2, "d": d,
                "weight_decay": weight_decay, "maximize": bool(group["maximize"])}


def betas_of(group):
    return pair("betas", group["betas"], "(beta1, beta2)")
