"""OffloadAdam / OffloadAdamW: torch.optim.Adam / AdamW with the fp32 master weights and the moments in CPU RAM
(offload="cpu") or in a swap file on NVMe (offload="nvme"). The machinery is OffloadOptimizer's; these classes
are Adam's rule (swapio.optim.rules.AdamRule), its group keys and its constructor, as torch.optim.AdamW is a thin
subclass of Adam."""
from .optimizer import OffloadOptimizer
from .rules import AdamRule


class OffloadAdam(OffloadOptimizer):
    """Adam (L2 weight decay, like torch.optim.Adam) with optimizer state off the GPU.

    Hyperparameters (per param group, validated like torch): lr, betas, eps, weight_decay, amsgrad, maximize,
    decoupled_weight_decay (True gives AdamW). Parameters may be on the CPU or a CUDA device, fp32, bf16 or
    fp16, or DTensors (FSDP2's fully_shard), whose local shards are stepped and keep the state. The optimizer
    keeps an fp32 master copy of every parameter that is not itself a contiguous fp32 CPU tensor, steps it on
    the CPU, and writes the result back into the parameter (for a GPU through pinned memory, copied on a side
    stream that the compute stream is made to wait for: the host does not wait; docs/optim.md, "Parameters on a
    GPU"). A parameter changed outside the optimizer since its last step
    (in-place writes, not through `.data`) has its changed elements adopted into the master, with one warning
    (docs/optim.md, "Master weights").

    offload: "cpu" keeps master and moments in RAM; "nvme" keeps them in a swap file in a private directory
        (mkdtemp, mode 0700) under swap_dir, removed by close() or when the optimizer is garbage collected.
        None (the default): "nvme" when swap_dir is given, else "cpu".
    buffer_bytes, buffer_count: pinned host memory for the nvme pipeline: buffer_count (>= 3) slots of
        buffer_bytes / buffer_count bytes in rotation (read of chunk i+1 || compute of chunk i || write of
        chunk i-1). Host memory used for the state stays within buffer_bytes whatever the model size. In cpu
        mode the same budget sizes the staging buffers for GPU parameters.
    cpu_threads: threads of the update kernel (None: every core this process may run on, os.sched_getaffinity).
    io_config: a JSON file (or dict) written by `swapio tune`; **io_kwargs: AioHandle settings (block_size,
        queue_depth, threads, engine, direct, submit_batch) overriding it. Used for the swap file and for save()/load().
    in_backward: update each offloaded module's weights (and, with offload="cpu", each GPU parameter) during
        backward, as soon as their gradients are complete, on a CPU thread while backward goes on; step()
        finishes what backward started. One backward per step, no clip_grad_norm_. See docs/offload.md,
        "Training", and docs/optim.md, "Parameters on a GPU".
    state_dtype: how the moments are stored: "fp32" (default), "bf16" (stochastic rounding) or "int8"
        (block-wise dynamic quantisation, 256 elements a block); the master copy stays fp32. Not with amsgrad.
        See swapio.optim.state_format and docs/optim.md ("Smaller state").
    """

    _rule_type = AdamRule
    _group_keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")
    _historical_defaults = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False}  # torch's Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, decoupled_weight_decay=False, offload=None, swap_dir=None,
                 buffer_bytes=256 << 20, buffer_count=4, cpu_threads=None, io_config=None, state_dtype="fp32",
                 in_backward=False, **io_kwargs):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "decoupled_weight_decay": bool(decoupled_weight_decay)}
        super().__init__(params, defaults, offload=offload, swap_dir=swap_dir, buffer_bytes=buffer_bytes,
                         buffer_count=buffer_count, cpu_threads=cpu_threads, io_config=io_config,
                         state_dtype=state_dtype, io_kwargs=io_kwargs,
                         in_backward=in_backward)


class OffloadAdamW(OffloadAdam):
    """AdamW (decoupled weight decay, like torch.optim.AdamW) with optimizer state off the GPU. See OffloadAdam."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, offload=None, swap_dir=None, buffer_bytes=256 << 20, buffer_count=4,
                 cpu_threads=None, io_config=None, state_dtype="fp32", in_backward=False,
                 **io_kwargs):
        if "decoupled_weight_decay" in io_kwargs:  # as torch.optim.AdamW, which does not take it either
            raise TypeError("OffloadAdamW always decouples its weight decay and takes no decoupled_weight_decay; "
                            "for a choice use OffloadAdam(decoupled_weight_decay=...)")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, offload=offload, swap_dir=swap_dir, buffer_bytes=buffer_bytes,
                         buffer_count=buffer_count, cpu_threads=cpu_threads, io_config=io_config,
                         state_dtype=state_dtype, in_backward=in_backward,
                         **io_kwargs)
