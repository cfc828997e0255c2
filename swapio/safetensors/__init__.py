"""swapio.safetensors: the safetensors format, read and written without the safetensors library, mmap or a state
dict. swapio.checkpoint and swapio.offload sit on top of it; it imports only swapio.core.

Reading:
    ckpt = open_checkpoint(path)      # a file, a save_pretrained directory or a sharded index; one header parse
    ckpt["w"]                         # a Location (file, offset, bytes, dtype, shape); ckpt.metadata, ckpt.files
    read_into([(location, tensor), ...], device)   # the bytes streamed into the tensors
    load_file(path, device)           # {name: tensor} (swapio.offload.load_file)
Writing:
    with FileWriter(path, layout.plan(entries, metadata)) as f:
        f.write(staging_bytes=..., handle=...); f.commit()

Modules: header (the strict header parser, Location), dtypes (names <-> torch dtypes), files (which files a path
names, the index), opened (open_checkpoint), reader (read_into, load_file), bytes_of (tensors as bytes), layout
(Entry, Plan: where each tensor goes), writer (the streaming O_DIRECT writer every file goes through), commit
(temporary file, lock, atomic publish), file_writer (FileWriter: plan, write, commit), buffers (the kept staging,
capture memory and handle).
"""
from .file_writer import DEFAULT_STAGING, FileWriter
from .header import Location
from .opened import SafetensorsCheckpoint, check_against, open_checkpoint
from .reader import load_file, read_into

__all__ = ["DEFAULT_STAGING", "FileWriter", "Location", "SafetensorsCheckpoint", "check_against", "load_file",
           "open_checkpoint", "read_into"]
