"""swapio.checkpoint: fast, crash-safe checkpoints of any training state, as safetensors files.

    swapio.checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100}, path)
    state = swapio.checkpoint.load(path)                      # the same structure back
    swapio.checkpoint.load(path, out={"model": model.state_dict(), ...})   # in place, no second copy
    fut = swapio.checkpoint.async_save(state, path); ...; fut.wait()

See docs/checkpoint.md. Modules: structure (nesting <-> named tensors), dtypes, layout (the padded safetensors
header), writer (the streaming O_DIRECT writer), commit (temporary file, lock, atomic publish), save, capture
and background (async_save), load, sharded (torch.distributed).
"""
from .buffers import release_buffers
from .load import load
from .save import DEFAULT_STAGING, save
from .save_async import async_save

__all__ = ["DEFAULT_STAGING", "async_save", "load", "release_buffers", "save"]
