"""The offload options every optimizer of the family takes, validated once: the pinned-buffer budget (whose slot
size both backends use) and the AioHandle settings."""
import inspect

from ..core import _align
from ..core._errors import check_int
from ..core.handle import AioHandle, check_moves_data, config_settings

IO_KEYS = tuple(k for k in inspect.signature(AioHandle.__init__).parameters if k != "self")
MIN_SLOT_BYTES = 64 << 10


class BufferBudget:
    """buffer_bytes of pinned host memory in buffer_count slots: the nvme pipeline rotates the slots (read ahead
    || compute || write behind); cpu mode sizes its GPU staging buffers by the same slot. slot_bytes is computed
    here only, aligned down for direct I/O."""

    def __init__(self, buffer_bytes, buffer_count):
        self.count = check_int("buffer_count", buffer_count, 3)
        self.total = check_int("buffer_bytes", buffer_bytes, 1)
        if self.total // self.count < MIN_SLOT_BYTES:
            raise ValueError(f"buffer_bytes / buffer_count must be at least 64 KiB, got {self.total} / "
                             f"{self.count}")
        self.slot_bytes = _align.round_down(self.total // self.count)

    @property
    def batch_bytes(self):
        return offloaded_batch_bytes(self.total)


def offloaded_batch_bytes(buffer_bytes):
    """Bytes of the batches in which the weights of offloaded models are updated (fp32 gradients, or the records'
    own bytes when larger): half the budget, so the two batches read or waiting at a time pin buffer_bytes (at
    least 1 MiB each)."""
    return max(buffer_bytes // 2, 1 << 20)


def io_settings(io_config, io_kwargs, owner="OffloadAdam"):
    """AioHandle settings: a `swapio tune` config (file or dict), overridden by keyword arguments. TypeError for
    an unknown keyword (foreach=, fused=, ...)."""
    unknown = sorted(set(io_kwargs) - set(IO_KEYS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}: {owner} takes its hyperparameters, "
                        f"offload options and AioHandle settings {list(IO_KEYS)} (it always steps with swapio's "
                        "fused CPU kernel, so foreach/fused/capturable/differentiable do not apply)")
    settings = {}
    if io_config is not None:  # (parsed as AioHandle.from_config does: a file holding a list, or io_config=3, gave
        # an AttributeError or a TypeError not naming it)
        settings.update(config_settings(io_config, "io_config"))
        AioHandle(**settings).close()  # validates the values now
    settings.update(io_kwargs)
    engine = settings.get("engine", "auto")  # ("auto": SWAPIO_ENGINE may force null)
    if isinstance(engine, str):  # ("null": an nvme state written nowhere, read back as garbage)
        check_moves_data(engine, owner)
    return settings

