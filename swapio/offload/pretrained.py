"""from_pretrained: a transformers model offloaded from its save_pretrained directory in one call.

swapio's counterpart of accelerate's load_checkpoint_and_dispatch and of transformers' from_pretrained with a
device_map: the model is built on meta (no memory for its weights), then disk_offload reads its weights in place
from the checkpoint. transformers stays an optional dependency: it is imported here, when called.
"""
import collections
import os

import torch

from ..core._errors import check_path
from ..safetensors.opened import open_checkpoint


def _checkpoint_dtype(locations):
    """The floating dtype most of the checkpoint's bytes are in (what save_pretrained wrote)."""
    count = collections.Counter()
    for loc in locations.values():
        if loc.dtype.is_floating_point:
            count[loc.dtype] += loc.nbytes
    return count.most_common(1)[0][0] if count else None


def _model_class(transformers, model_class_or_config, directory):
    """(config, a callable building the model from it)."""
    if isinstance(model_class_or_config, transformers.PretrainedConfig):
        config = model_class_or_config
        names = getattr(config, "architectures", None) or []
        if not names:  # no head recorded: the AutoModel mapping, as AutoModel.from_config does
            return config, lambda **kw: transformers.AutoModel.from_config(config, **kw)
        cls = getattr(transformers, names[0], None)
        if cls is None:
            raise ValueError(f"the config's architectures names {names[0]!r}, which this transformers does not have; "
                             "pass the model class instead of the config")
        return config, lambda **kw: cls._from_config(config, **kw)
    if isinstance(model_class_or_config, type):
        cls = model_class_or_config
        config = transformers.AutoConfig.from_pretrained(directory)
        if cls.__name__.startswith("AutoModel"):
            return config, lambda **kw: cls.from_config(config, **kw)
        if issubclass(cls, transformers.PreTrainedModel):
            return config, lambda **kw: cls._from_config(config, **kw)
    raise TypeError("from_pretrained needs a transformers model class (such as LlamaForCausalLM or "
                    f"AutoModelForCausalLM) or a transformers config, got {model_class_or_config!r}")


DISK_OFFLOAD_ARGUMENTS = ("offload_dir", "execution_device", "offload_buffers", "preload_module_classes", "prefetch",
                          "buffer_bytes", "keep_resident", "handle", "progress")


def _device_of(device_map):
    """The one execution device a transformers device_map names ("auto": the GPU when there is one), else a
    ValueError: swapio computes every module on one device, streaming the weights there."""
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) == 1 and not {"disk", "meta"} & devices:
            device_map = devices.pop()
        else:
            raise ValueError(f"device_map={device_map!r}: swapio streams every module's weights from the checkpoint "
                             "to one execution device, so a per-module map has no meaning here; pass "
                             "execution_device=... (or device_map='auto'), and keep_resident=[module names] for "
                             "modules to keep in memory")
    if isinstance(device_map, str) and device_map == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return device_map


def from_pretrained(model_class_or_config, checkpoint_dir, *, dtype=None, torch_dtype=None, device_map=None,
                    low_cpu_mem_usage=None, **disk_offload_kwargs):
    """A transformers model with its weights offloaded to the save_pretrained directory `checkpoint_dir`, in eval
    mode. `model_class_or_config`: a model class (LlamaForCausalLM, or an Auto class such as
    AutoModelForCausalLM), with the config read from the directory; or a config, whose `architectures` names the
    class (AutoModel's mapping when it names none). `dtype` (or transformers' older name, `torch_dtype`): None or
    "auto" (the default), the checkpoint's; a dtype or its name ("bfloat16", as transformers takes it) other than
    the checkpoint's is a ValueError, since the weights are read in place, not converted. `device_map`:
    transformers' argument, for one execution device ("auto": the GPU when there is one, "cpu", "cuda:1",
    {"": 0}). `low_cpu_mem_usage` is accepted (loading never holds the weights in memory). Other keyword
    arguments go to disk_offload (offload_dir, prefetch, buffer_bytes, execution_device, keep_resident,
    handle, offload_buffers, preload_module_classes, progress). The checkpoint is never written: with `offload_dir`,
    the weights an optimizer trains or peft merges are written there (disk_offload(checkpoint=..., offload_dir=...));
    without it, both are refused."""
    try:
        import transformers
    except ImportError:
        raise ImportError("swapio.offload.from_pretrained needs transformers (pip install transformers); "
                          "for other models build them on meta and call disk_offload(model, checkpoint=...)") \
            from None
    from .api import disk_offload
    if "checkpoint" in disk_offload_kwargs:
        raise TypeError("from_pretrained reads the weights from checkpoint_dir; checkpoint= is not an argument")
    for name in disk_offload_kwargs:
        if name not in DISK_OFFLOAD_ARGUMENTS:
            raise TypeError(f"swapio.offload.from_pretrained() got an unexpected keyword argument {name!r} (it takes "
                            "dtype/torch_dtype, device_map, low_cpu_mem_usage and disk_offload's "
                            f"{', '.join(DISK_OFFLOAD_ARGUMENTS)}). Settings of the model's config, such as "
                            "attn_implementation= or use_cache=, go in the config you pass instead of the class: "
                            f"from_pretrained(AutoConfig.from_pretrained(checkpoint_dir, {name}=...), checkpoint_dir)")
    if torch_dtype is not None:
        if dtype is not None:
            raise TypeError("pass dtype= or torch_dtype= (its older name), not both")
        dtype = torch_dtype
    if device_map is not None:
        if "execution_device" in disk_offload_kwargs:
            raise TypeError("pass device_map= or execution_device=, not both: both name where the model computes")
        disk_offload_kwargs["execution_device"] = _device_of(device_map)
    directory = check_path("checkpoint_dir", checkpoint_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint_dir {directory} is not a directory (save_pretrained's output)")
    config, build = _model_class(transformers, model_class_or_config, directory)
    opened = open_checkpoint(directory)  # parsed once: disk_offload takes it as the checkpoint
    stored = _checkpoint_dtype(opened) or torch.get_default_dtype()
    if isinstance(dtype, str) and dtype != "auto" and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)  # "bfloat16", as transformers takes it (a config's torch_dtype is one)
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        dtype = stored
    elif not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, its name ('bfloat16') or 'auto', got {dtype!r}")
    elif dtype != stored:
        raise ValueError(f"{directory} holds {stored} weights, and from_pretrained reads them in place without "
                         f"converting: dtype={dtype} cannot be served. Use dtype='auto' (or None), or convert the "
                         "checkpoint once (transformers' from_pretrained(torch_dtype=...) then save_pretrained)")
    with torch.device("meta"):
        model = build(dtype=dtype)
    generation = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation) and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    disk_offload(model, checkpoint=opened, **disk_offload_kwargs)
    return model.eval()
