"""open_checkpoint(path): a safetensors checkpoint from one parse of each file's header, like the safetensors
library's safe_open: every tensor's Location (file, offset, bytes, dtype, shape) by name, the files, the index's
weight map and the __metadata__, all from that one read. Loaders take what they need from it; none reads a header
again.
"""
import os
from collections.abc import Mapping

from ..core._errors import check_path
from .files import checkpoint_files, raw_header
from .header import parse_header


class SafetensorsCheckpoint(Mapping):
    """{tensor name: Location} of a checkpoint (a read-only mapping), with `path` (as given), `files` (its
    .safetensors files), `weight_map` (the index's {name: file}; None without an index) and `metadata` (the
    __metadata__ of a checkpoint held in one file; {} for one sharded over several). It is path-like (its path),
    so that a caller that parsed the headers already hands the result on where a checkpoint path is taken
    (open_checkpoint returns it as it is)."""

    def __init__(self, path, files, weight_map, locations, metadata):
        self.path, self.files, self.weight_map = path, files, weight_map
        self._locations, self.metadata = locations, metadata

    def __getitem__(self, name):
        return self._locations[name]

    def __iter__(self):
        return iter(self._locations)

    def __len__(self):
        return len(self._locations)

    def __fspath__(self):
        return self.path

    def __repr__(self):
        return f"SafetensorsCheckpoint({self.path!r}: {len(self)} tensors in {len(self.files)} file(s))"


def open_checkpoint(checkpoint):
    """The SafetensorsCheckpoint of a path (a .safetensors file, a save_pretrained directory or a sharded index);
    ValueError naming the file (and the tensor) on any defect of a header or of the index. An opened checkpoint is
    returned as it is (no header is read again)."""
    if isinstance(checkpoint, SafetensorsCheckpoint):
        return checkpoint
    checkpoint = check_path("checkpoint", checkpoint)  # (a bytes path as str: the shard names joined to it are)
    files, weight_map = checkpoint_files(checkpoint)
    locations, metadata = {}, {}
    for path in files:
        raw, size, source = raw_header(path)
        found, metadata = parse_header(path, raw, size, source)
        locations.update(found)
    if weight_map is not None:
        for name, path in weight_map.items():
            if name not in locations or locations[name].path != path:
                raise ValueError(f"{path}: the index says it holds tensor {name!r}, but it does not")
    return SafetensorsCheckpoint(os.fspath(checkpoint), files, weight_map, locations,
                                 metadata if len(files) == 1 else {})


def check_against(locations, name, shape, dtype, checkpoint):
    """The Location of a model tensor (any of its names) in {name: Location}, checked for shape and dtype;
    ValueError otherwise."""
    names = [name] if isinstance(name, str) else list(name)
    for n in names:
        loc = locations.get(n)
        if loc is None:
            continue
        if loc.shape != tuple(shape):
            raise ValueError(f"{loc.path}: tensor {n!r} has shape {list(loc.shape)}, the model expects "
                             f"{list(shape)}")
        if loc.dtype != dtype:
            raise ValueError(f"{loc.path}: tensor {n!r} is {loc.dtype}, the model expects {dtype} (build or cast "
                             "the model in the checkpoint's dtype)")
        return loc
    raise ValueError(f"checkpoint {os.fspath(checkpoint)} lacks tensor {names[0]!r}"
                     + (f" (also looked for {names[1:]})" if len(names) > 1 else ""))
