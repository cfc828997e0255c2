"""OffloadLion: Lion with the fp32 master weights and its one moment in CPU RAM or on NVMe (OffloadOptimizer's
machinery: offload modes, pipeline, state dicts, streaming checkpoints), stepping with swapio.ops.lion_step_."""
from .optimizer import OffloadOptimizer
from .rules import LionRule


class OffloadLion(OffloadOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with optimizer state off the GPU:

        update = sign(beta1 * exp_avg + (1 - beta1) * grad)
        param = param * (1 - lr * weight_decay) - lr * update       (decoupled weight decay)
        exp_avg = beta2 * exp_avg + (1 - beta2) * grad

    One moment instead of Adam's two: 8 bytes of fp32 state per parameter (4 with an fp32 parameter that is its
    own master) instead of 12; with state_dtype="bf16" 2 bytes, with "int8" about 1. Lion wants a smaller lr
    than AdamW (3-10x) and a larger weight_decay; the defaults are the paper's lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0.0. The other arguments are OffloadAdam's.
    """

    _rule_type = LionRule
    _group_keys = ("lr", "betas", "weight_decay", "maximize")
    _historical_defaults = {"maximize": False}

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, offload=None,
                 swap_dir=None, buffer_bytes=256 << 20, buffer_count=4, cpu_threads=None, io_config=None,
                 state_dtype="fp32", in_backward=False,
                 **io_kwargs):
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults, offload=offload, swap_dir=swap_dir, buffer_bytes=buffer_bytes,
                         buffer_count=buffer_count, cpu_threads=cpu_threads, io_config=io_config,
                         state_dtype=state_dtype, io_kwargs=io_kwargs,
                         in_backward=in_backward)
