"""OffloadAdafactor: torch.optim.Adafactor with the fp32 master weights and the factored second moments in CPU
RAM or on NVMe (OffloadOptimizer's machinery), stepping with swapio.ops.adafactor_step_."""
from .optimizer import OffloadOptimizer
from .rules import AdafactorRule
from .transformers_adafactor import refuse_transformers_args, refuse_transformers_state


class OffloadAdafactor(OffloadOptimizer):
    """Adafactor (Shazeer & Stern 2018) as torch.optim.Adafactor defines it, with optimizer state off the GPU:

        rho = min(lr, 1/sqrt(t));  alpha = max(eps2, RMS(param)) * rho;  param *= 1 - lr * weight_decay
        matrices (the last two dimensions): row_var, col_var = lerp towards the row / column means of grad^2
            with weight t ** beta2_decay;  v = row_var * col_var / max(mean(row_var), eps1)
        vectors: variance = lerp(variance, grad^2, t ** beta2_decay);  v = variance
        u = grad / max(sqrt(v), eps1);  param -= alpha * u / max(1, RMS(u) / d)

    No first moment; the second moment of a matrix takes rows + cols numbers (a 4096 x 4096 weight: 32 KiB
    instead of Adam's 128 MiB), so the state is the fp32 master (bf16/fp16 and GPU parameters, as for
    OffloadAdamW) plus next to nothing. The defaults are torch's: lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3)
    (eps1=None: float32's machine epsilon, the dtype the step computes in), d=1.0, weight_decay=0.0.
    state_dict() is torch.optim.Adafactor's format ("step", "row_var"/"col_var" or "variance"; "master" for
    bf16/fp16 parameters): each loads the other's.

    The step needs each parameter whole (its norm and its update's are reductions over all of it), so a
    parameter is never split: in nvme mode a pipeline slot holds at least the largest parameter's record (its
    master, 4 bytes an element, for bf16/fp16 or GPU parameters), beyond buffer_bytes / buffer_count if need be.
    transformers.Adafactor's arguments (relative_step, scale_parameter, warmup_init, clip_threshold, decay_rate,
    beta1, lr=None) raise a TypeError naming the nearest torch setting, here or in a param group (torch's
    algorithm differs from transformers' in the eps1 rule): use transformers.Adafactor resident for its own.
    foreach is accepted for torch's signature and has no effect. Not with state_dtype other than "fp32". The
    other arguments are OffloadAdam's.
    """

    _rule_type = AdafactorRule
    _group_keys = ("lr", "beta2_decay", "eps", "d", "weight_decay", "foreach", "maximize")
    _historical_defaults = {"foreach": None, "maximize": False}

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, *,
                 foreach=None, maximize=False, offload=None, swap_dir=None, buffer_bytes=256 << 20,
                 buffer_count=4, cpu_threads=None, io_config=None, state_dtype="fp32", in_backward=False,
                 **io_kwargs):
        refuse_transformers_args(io_kwargs)  # before the generic unknown-keyword error: name torch's equivalents
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": tuple(eps) if isinstance(eps, list) else eps,
                    "d": d, "weight_decay": weight_decay, "foreach": foreach, "maximize": maximize}
        super().__init__(params, defaults, offload=offload, swap_dir=swap_dir, buffer_bytes=buffer_bytes,
                         buffer_count=buffer_count, cpu_threads=cpu_threads, io_config=io_config,
                         state_dtype=state_dtype, io_kwargs=io_kwargs, in_backward=in_backward)

    def check_group(self, group):
        refuse_transformers_state(group)  # transformers.Adafactor's: say whose, not only which torch keys it lacks
        super().check_group(group)
