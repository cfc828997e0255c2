"""swapio.info(): what this machine and a path give swapio."""
import os
import platform
import resource
import tempfile

import torch

from . import _C, __version__, ops


def _probe_path(path):
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return {"path": path, **_C.probe_file(path)}
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    fd, probe = tempfile.mkstemp(prefix=".swapio-probe-", dir=directory)
    os.close(fd)
    try:
        return {"path": path, **_C.probe_file(probe)}
    finally:
        os.unlink(probe)


def info(path=None):
    """A dict: engines usable here (or why not), the engine "auto" picks, O_DIRECT support and alignment for
    `path` (a file or directory), the Adam kernel's SIMD level, threads, CUDA pinning, versions."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    result = {
        "version": __version__,
        "engines": _C.engine_status(),
        "auto_engine": _C.auto_engine(),
        "adam_simd": ops.cpu_capability(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda_pinning": torch.cuda.is_available(),
        "memlock_limit": None if soft == resource.RLIM_INFINITY else soft,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    if path is not None:
        result["path"] = _probe_path(path)
    return result
