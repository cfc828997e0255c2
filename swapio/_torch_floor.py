"""The oldest torch swapio runs on, checked at `import swapio`.

Below it swapio does not merely lack a feature. Before 2.11 torch.autograd.backward does not offer its inputs=
to __torch_function__, so `loss.backward(inputs=[offloaded weight])` could not be refused and silently gave no
gradient (2.9, 2.10). On 2.8 weight offload's check that nothing kept a fetched weight refused sound training
("something still references the tensor"); 2.6 and 2.7 lack torch._C._autograd._top_saved_tensors_default_hooks,
which activation offload needs; 2.1 crashed (segfault) in a failed activation unpack and its increment_version
takes no list (checkpoint and optimizer loads failed). A clear ImportError at the import beats a crash or a wrong
result halfway through training. pyproject.toml's dependency and README.md's "Supported torch versions" name the
same version; tests/package/test_torch_floor.py keeps the three equal.
"""
import re

import torch

MINIMUM = (2, 11)


def parse(version: str) -> "tuple[int, int]":
    """(major, minor) of a torch version string: "2.14.1+cu130", "2.6.0a0+git1234", "2.7.0.dev20250101"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"swapio cannot read torch's version {version!r} (torch.__version__); it needs torch >= "
                          f"{MINIMUM[0]}.{MINIMUM[1]}")
    return int(m.group(1)), int(m.group(2))


def check(version: "str | None" = None) -> None:
    """Raises ImportError naming the torch needed when `version` (torch.__version__ by default) is older."""
    version = str(torch.__version__) if version is None else version
    if parse(version) < MINIMUM:
        need = f"{MINIMUM[0]}.{MINIMUM[1]}"
        raise ImportError(f"swapio needs torch >= {need}, but this Python has torch {version} "
                          f"({torch.__file__}). Upgrade it: pip install 'torch>={need}'.")
