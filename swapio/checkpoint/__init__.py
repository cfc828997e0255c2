"""swapio.checkpoint: fast, crash-safe checkpoints of any training state, as safetensors files.

    swapio.checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 100}, path)
    state = swapio.checkpoint.load(path)                      # the same structure back
    swapio.checkpoint.load(path, out={"model": model.state_dict(), ...})   # in place, no second copy
    fut = swapio.checkpoint.async_save(state, path); ...; fut.wait()

See docs/checkpoint.md. It sits on swapio.safetensors (the format: header, reader, layout, the streaming writer,
commit). Modules: structure (nesting <-> named tensors), format (the structure in the header, the plan of a
state's file), save (one file), capture and background (async_save), load (one file back), sharded
(torch.distributed) and sharded_index (its index), api (save and load as called: the distributed dispatch).
"""
from ..safetensors.buffers import release_buffers
from ..safetensors.file_writer import DEFAULT_STAGING
from .api import load, save
from .save_async import async_save

__all__ = ["DEFAULT_STAGING", "async_save", "load", "release_buffers", "save"]
