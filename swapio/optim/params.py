"""What a parameter is to the offloaded optimizers: the tensor stepped (a DTensor's local shard), the dtypes
supported, and whether an fp32 master copy is kept for it."""
import torch

FP32 = torch.float32
LOW_PRECISION = (torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MASTER = "master"  # the state field holding the fp32 master copy


def shard(t):
    """The tensor the optimizer steps for parameter (or gradient) t: the local shard of a DTensor (FSDP2's
    fully_shard, tensor parallelism), else t itself. State is kept per shard, shaped like it."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def on_gpu(t):
    """Whether the optimizer steps t (a parameter or its shard) through the GPU staging path."""
    return shard(t).device.type == "cuda"


def needs_master(p):
    """An fp32 copy kept by the optimizer is needed unless the parameter itself is a contiguous fp32 CPU tensor
    (then the kernel updates it in place and it is its own master)."""
    p = shard(p)
    return on_gpu(p) or not (p.device.type == "cpu" and p.dtype == FP32 and p.is_contiguous())
