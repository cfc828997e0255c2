"""transformers.Adafactor's arguments, which OffloadAdafactor (torch.optim.Adafactor's algorithm) refuses wherever
they come (constructor, param groups): a TypeError naming each one's nearest torch setting, never a silent ignore
(torch keeps unknown param-group keys without a word). The equivalences are checked against transformers itself
(tests/optim/test_optim_adafactor_hostile.py)."""

# each argument -> its nearest torch.optim.Adafactor setting
EQUIVALENTS = {
    "relative_step": "relative_step: torch's step is always relative, min(lr, 1/sqrt(t)); lr=1e-2 (the default) is "
                     "transformers' relative_step=True, and a fixed step (relative_step=False) has no equivalent",
    "scale_parameter": "scale_parameter: torch always scales the step by max(eps2, RMS(param)), as "
                       "scale_parameter=True; scale_parameter=False has no equivalent",
    "warmup_init": "warmup_init: lr=1e-6 with torch.optim.lr_scheduler.LambdaLR(opt, lambda e: e + 1) stepped after "
                   "each step gives its min(1e-6 * t, 1/sqrt(t))",
    "clip_threshold": "clip_threshold: d",
    "decay_rate": "decay_rate: beta2_decay",
    "beta1": "beta1: none, torch's Adafactor keeps no first moment",
}
_TAIL = ("; eps: transformers adds eps1 to g^2, torch clamps with it, so give eps=(None, 1e-3) (torch's default) "
         "rather than transformers' (1e-30, 1e-3) (docs/optim.md, \"Adafactor\"). For transformers' algorithm "
         "itself use transformers.Adafactor resident")


def refuse_transformers_args(keys):
    """TypeError if any of `keys` (constructor keywords or a param group's keys) is transformers.Adafactor's."""
    theirs = [k for k in EQUIVALENTS if k in keys]
    if theirs:
        raise TypeError(f"OffloadAdafactor follows torch.optim.Adafactor; transformers.Adafactor's {sorted(theirs)} "
                        "have no place in it. Nearest torch.optim.Adafactor settings: "
                        + "; ".join(EQUIVALENTS[k] for k in sorted(theirs)) + _TAIL)


def refuse_lr_none(lr):
    if lr is None:
        raise TypeError("lr=None is transformers.Adafactor's relative step; torch.optim.Adafactor's lr is a number, "
                        "the cap of its relative step min(lr, 1/sqrt(t)): lr=1e-2 (the default) is transformers' "
                        "relative_step=True with scale_parameter=True" + _TAIL)


def refuse_transformers_state(group):
    """ValueError for a param group of transformers.Adafactor's state dict (its arguments, none of torch's): its
    state is another algorithm's, which no key-by-key check would name."""
    theirs = sorted(k for k in EQUIVALENTS if k in group)
    if theirs and not ("beta2_decay" in group or "d" in group):
        raise ValueError(f"a state dict of transformers.Adafactor (its param group holds {theirs}): its moments "
                         "(exp_avg_sq_row / exp_avg_sq_col, with eps1 added to g^2) are not torch.optim.Adafactor's "
                         "row_var / col_var, so it does not load into OffloadAdafactor. Finish that run with "
                         "transformers.Adafactor, or start OffloadAdafactor's state afresh from the model's weights")
