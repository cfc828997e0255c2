"""swapio: move PyTorch tensors between memory and fast storage.

Async O_DIRECT reads and writes (io_uring, Linux AIO, or a pread/pwrite pool) into page-locked buffers,
tensor swap handles, a SIMD CPU Adam kernel, offloaded optimizers and parameter (weight) offload.
"""
import sys

from . import _interrupt

# `python -m swapio` and the `swapio` script import the package first: Ctrl-C while torch loads ends the command
# with one line and status 130, as later (a program importing swapio keeps its KeyboardInterrupt)
with _interrupt.exits_quietly_if_the_command():
    from ._version import __version__
    from ._torch_floor import check as _check_torch

    _check_torch()  # an older torch: an ImportError naming the version needed, not a crash later
    try:
        from . import _C  # noqa: E402  (the native core; built by `pip install .`)
    except ImportError as _exc:  # without this, Python blames a "circular import"
        from ._native_missing import explain as _explain
        raise ImportError(_explain(__path__[0], _exc), name="swapio._C") from None
    from .core._errors import SwapioWarning  # noqa: E402
    from .core.futures import Future  # noqa: E402
    from .core.handle import AioHandle  # noqa: E402
    from .info import info  # noqa: E402
    from .core.pinned import empty_pinned, is_pinned  # noqa: E402
    from .swap import SwappedTensor, SwapStore  # noqa: E402

    from . import checkpoint, offload, optim
    from .kernels import ops  # noqa: E402,F401

    # swapio.ops and swapio.quant are public module paths; they live in swapio/kernels/ with the hyperparameter
    # checks they share, and stay importable (import swapio.ops, from swapio import quant) under these names.
    from .kernels import ops, quant  # noqa: E402
    sys.modules[__name__ + ".ops"], sys.modules[__name__ + ".quant"] = ops, quant

__all__ = ["AioHandle", "Future", "SwapStore", "SwappedTensor", "SwapioWarning", "checkpoint", "empty_pinned",
           "info", "is_pinned", "offload", "ops", "optim", "__version__"]
