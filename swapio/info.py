"""swapio.info(): what this machine and a path give swapio."""
import os
import platform
import resource
from typing import Any, Dict, Optional

import torch

from . import _C
from ._version import __version__
from .kernels import ops
from .core._errors import StrPath
from .core._unnamed_file import ScratchFile


def _probe_path(path: "StrPath") -> Dict[str, Any]:
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return {"path": path, **_C.probe_file(path)}
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    scratch = ScratchFile(directory)  # unnamed where /proc reaches it: nothing left if the process is killed
    try:
        return {"path": path, **_C.probe_file(scratch.path)}
    finally:
        scratch.close()


CAP_IPC_LOCK = 14  # linux/capability.h


def cap_ipc_lock(status_text: Optional[str] = None) -> bool:
    """Whether this process has CAP_IPC_LOCK in its effective capability set (root has it, unless a container
    drops it). With it, mlock ignores RLIMIT_MEMLOCK, so `ulimit -l` does not bound swapio's pinned buffers.
    `status_text`: the contents of /proc/self/status (read when None); False where it cannot be read."""
    if status_text is None:
        try:
            with open("/proc/self/status") as f:
                status_text = f.read()
        except OSError:
            return False
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def info(path: "Optional[StrPath]" = None) -> Dict[str, Any]:
    """A dict: engines usable here (or why not), the engine "auto" picks, O_DIRECT support and alignment for
    `path` (a file or directory), the Adam kernel's SIMD level, threads, CUDA pinning, the memlock limit
    (`memlock_limit`: ulimit -l in bytes, None if unlimited; `cap_ipc_lock`: True when the process may lock
    memory past that limit, as root usually may), versions."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    result = {
        "version": __version__,
        "engines": _C.engine_status(),
        "auto_engine": _C.auto_engine(),
        "adam_simd": ops.cpu_capability(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cuda_pinning": torch.cuda.is_available(),
        "memlock_limit": None if soft == resource.RLIM_INFINITY else soft,  # ulimit -l, in bytes
        "cap_ipc_lock": cap_ipc_lock(),  # True: memlock_limit does not apply to this process
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    if path is not None:
        result["path"] = _probe_path(path)
    return result
