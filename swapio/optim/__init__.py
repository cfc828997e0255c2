"""Drop-in torch.optim.Adam / AdamW / Adafactor (and Lion) whose fp32 master weights and moments live in CPU RAM
or on NVMe.

    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-3, offload="nvme", swap_dir="/nvme/tmp")

See OffloadAdam for the arguments, OffloadOptimizer for what the family shares, swapio.optim.checkpoint for the
streaming checkpoint format.
"""
from .offload_adafactor import OffloadAdafactor
from .offload_adam import OffloadAdam, OffloadAdamW
from .offload_lion import OffloadLion
from .optimizer import OffloadOptimizer

__all__ = ["OffloadOptimizer", "OffloadAdam", "OffloadAdamW", "OffloadLion", "OffloadAdafactor"]
