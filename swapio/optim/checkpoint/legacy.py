"""Optimizer checkpoints of versions <= 3, read only: swapio-optim.pt (torch.save metadata with each array's offset
and checksum) beside a raw swapio-optim-<hex>.bin. Only where the offsets and checksums come from differs from
version 4 (read_meta); the arrays are read the same way (restore.py)."""
import torch

from ...core._owned_fd import OwnedFd
from .. import validate
from .files import FORMAT


def read_legacy_meta(meta_path):
    """The torch.save metadata of a version <= 3 checkpoint (offsets and checksums of its raw data file), its
    format and data file name checked (swapio.optim.validate checks the rest)."""
    # opened without blocking and checked before torch.load reads it: a FIFO in its place would hang the load
    with OwnedFd.open_regular(meta_path, "a checkpoint file") as owned:
        try:
            with open(owned.fileno(), "rb", closefd=False) as f:  # borrowed: `owned` alone closes it
                meta = torch.load(f, map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the unpickler makes of a damaged file
            raise ValueError(f"{meta_path} is not a readable swapio optimizer checkpoint: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a swapio optimizer checkpoint")
    validate.legacy_data_name(meta, meta_path)
    return meta
