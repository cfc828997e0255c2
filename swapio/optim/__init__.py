"""Drop-in torch.optim.Adam / AdamW whose fp32 master weights and moments live in CPU RAM or on NVMe.

    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-3, offload="nvme", swap_dir="/nvme/tmp")

See OffloadAdam for the arguments, swapio.optim.checkpoint for the streaming checkpoint format.
"""
from .offload_adam import OffloadAdam, OffloadAdamW

__all__ = ["OffloadAdam", "OffloadAdamW"]
