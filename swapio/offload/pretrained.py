"""from_pretrained: a transformers model offloaded from its save_pretrained directory in one call.

swapio's counterpart of accelerate's load_checkpoint_and_dispatch and of transformers' from_pretrained with a
device_map: the model is built on meta (no memory for its weights), then disk_offload reads its weights in place
from the checkpoint. transformers stays an optional dependency: it is imported here, when called.
"""
import collections
import os

import torch

from .safetensors_format import open_checkpoint


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


def from_pretrained(model_class_or_config, checkpoint_dir, *, dtype=None, **disk_offload_kwargs):
    """A transformers model with its weights offloaded to the save_pretrained directory `checkpoint_dir`, in eval
    mode. `model_class_or_config`: a model class (LlamaForCausalLM, or an Auto class such as
    AutoModelForCausalLM), with the config read from the directory; or a config, whose `architectures` names the
    class (AutoModel's mapping when it names none). `dtype`: None or "auto" (the default), the checkpoint's;
    another dtype is a ValueError, since the weights are read in place, not converted. Other keyword arguments go to disk_offload (prefetch,
    buffer_bytes, execution_device, keep_resident, handle, offload_buffers)."""
    try:
        import transformers
    except ImportError:
        raise ImportError("swapio.offload.from_pretrained needs transformers (pip install transformers); "
                          "for other models build them on meta and call disk_offload(model, checkpoint=...)") \
            from None
    from .api import disk_offload
    for name in ("checkpoint", "offload_dir"):
        if name in disk_offload_kwargs:
            raise TypeError(f"from_pretrained reads the weights from checkpoint_dir; {name}= is not an argument")
    directory = os.fspath(checkpoint_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint_dir {directory} is not a directory (save_pretrained's output)")
    config, build = _model_class(transformers, model_class_or_config, directory)
    stored = _checkpoint_dtype(open_checkpoint(directory)) or torch.get_default_dtype()
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        dtype = stored
    elif not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    elif dtype != stored:
        raise ValueError(f"{directory} holds {stored} weights, and from_pretrained reads them in place without "
                         f"converting: dtype={dtype} cannot be served. Use dtype='auto' (or None), or convert the "
                         "checkpoint once (transformers' from_pretrained(torch_dtype=...) then save_pretrained)")
    with torch.device("meta"):
        model = build(dtype=dtype)
    generation = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation) and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    disk_offload(model, checkpoint=directory, **disk_offload_kwargs)
    return model.eval()
