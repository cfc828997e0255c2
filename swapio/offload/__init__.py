"""swapio.offload: run models whose weights do not fit, streaming them from pinned RAM or NVMe with prefetch.

accelerate's names and arguments (cpu_offload, cpu_offload_with_hook, disk_offload), so that switching is one
import; remove_offload undoes them; save_checkpoint writes an offloaded model's current weights as safetensors. See
docs/offload.md. offload_activations moves the tensors autograd saves for backward to pinned RAM or NVMe (see
docs/activations.md).
"""
from ..safetensors.reader import load_file
from .activations import (ActivationOffload, disable_activation_offload, enable_activation_offload,
                          offload_activations)
from .api import cpu_offload, cpu_offload_with_hook, disk_offload, remove_offload, stats
from .chain import CpuOffloadHook
from .export import save_checkpoint
from .pretrained import from_pretrained

__all__ = ["ActivationOffload", "CpuOffloadHook", "disable_activation_offload", "enable_activation_offload",
           "offload_activations", "cpu_offload", "cpu_offload_with_hook", "disk_offload", "from_pretrained", "load_file",
           "remove_offload", "save_checkpoint", "stats"]
