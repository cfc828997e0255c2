"""read_state(opened): a checkpoint back as the structure that was saved, or in place into existing tensors (out=)
(swapio.checkpoint.load's single-file case; api.py).

Reading: a CPU tensor of at least 1 MiB is read by its own O_DIRECT request, in flight with all the others. Into
ordinary memory (a new tensor, or one given in out=) the request is staged: the device reads into the handle's
huge-page bounce buffers and the workers copy out of them, pipelined with the device. Measured here (ext4 over
virtio-blk), that ran at the device's pace, where reading straight into the tensors' small pages ran at 0.63-0.81x
of it (a 2 GiB state: 0.66x into new memory, 0.82x into a state dict's) and the copy costs CPU time only. Into
swapio pinned memory (huge pages already) it reads straight in, with no copy when the address is congruent to
the file offset modulo 4 KiB. The rest (small tensors, GPU tensors) stream through pinned windows and are
copied into place.

Any safetensors file, save_pretrained directory or sharded index loads (as {name: tensor}, like
safetensors.torch.load_file); a file swapio wrote comes back as the nested structure it was saved from. The
header is parsed once, and the bytes streamed, by swapio.safetensors (open_checkpoint, read_into): one reader in
the library. Everything is checked before a byte is read into `out`: that the file holds every
tensor, whole (not truncated), with the dtype and shape of the tensor it goes into.
"""
import torch

from .. import _C
from ..core import cuda_copy
from ..core._align import ALIGN, round_up
from ..core._in_flight import InFlight
from ..core.tensors import storage_bytes_needed
from ..safetensors import buffers, layout
from ..safetensors.bytes_of import copyable
from ..safetensors.dtypes import dtype_from_name
from ..safetensors.files import check_unchanged
from ..safetensors.opened import open_checkpoint
from ..safetensors.reader import read_into
from ..safetensors.writer import wait_all
from . import detached
from .format import skeleton_of
from .structure import dense, flatten, renamed, tensor_nodes, tensor_paths, unflatten

DEFAULT_STAGING = 128 << 20
DIRECT_MIN = layout.SMALL  # CPU tensors at least this big are read by their own request (see the module)
RUN_GAP = 256 << 10   # streamed tensors closer than this are read together, the bytes between them included


class _Target:
    """What one stored tensor loads as: dtype, shape, strides (None: contiguous), and its Location."""

    __slots__ = ("loc", "dtype", "shape", "stride", "parameter", "requires_grad")

    def __init__(self, node, loc, where):
        self.loc = loc
        name = node["T"]
        if "dtype" in node:  # stored as raw bytes
            self.dtype = dtype_from_name(node["dtype"], f"{where}: tensor {name!r}")
            if loc.dtype != torch.uint8 or not loc.shape or loc.shape[-1] != self.dtype.itemsize:
                raise ValueError(f"{where}: tensor {name!r} should hold {self.dtype} as bytes (U8 with a last "
                                 f"dimension of {self.dtype.itemsize}), the header says {loc.dtype} "
                                 f"{list(loc.shape)}")
            self.shape = tuple(loc.shape[:-1])
        else:
            self.dtype, self.shape = loc.dtype, tuple(loc.shape)
        # (a shape whose storage size overflows was refused with the header: a raw one's is the same)
        self.stride = None
        if "stride" in node:
            stride = node["stride"]
            # only what save writes, a dense order of the elements: other strides would make empty_strided
            # allocate what the file names (terabytes), overflow, or alias elements to each other
            if not isinstance(stride, list) or len(stride) != len(self.shape) \
                    or not all(type(s) is int and s >= 0 for s in stride) or not dense(self.shape, stride):
                raise ValueError(f"{where}: tensor {name!r} has malformed strides {str(node['stride'])[:200]} (save "
                                 f"writes strides that hold its shape {list(self.shape)} densely)")
            self.stride = tuple(stride)
        for flag in ("p", "g"):
            if node.get(flag, 1) != 1:
                raise ValueError(f"{where}: tensor {name!r} has a malformed {flag!r} flag {str(node[flag])[:50]}")
        self.parameter, self.requires_grad = "p" in node, "g" in node
        if self.requires_grad and not (self.dtype.is_floating_point or self.dtype.is_complex):
            raise ValueError(f"{where}: tensor {name!r} is {self.dtype} and cannot require grad")

    def wrap(self, t):
        """t as saved: an nn.Parameter, requiring grad (as torch.load gives them; a non-leaf as a leaf)."""
        if self.parameter:
            return torch.nn.Parameter(t, requires_grad=self.requires_grad)
        return t.requires_grad_() if self.requires_grad else t

    def byte_view(self, t):
        """t's bytes as the file stores them (t contiguous)."""
        return copyable(t).reshape(-1).view(torch.uint8)


def _targets(skeleton, locations, where):
    nodes, targets = tensor_nodes(skeleton), {}
    for node in nodes:
        name = node.get("T")
        if not isinstance(name, str):
            raise ValueError(f"{where}: malformed tensor node {node!r} in the structure")
        if name in targets:
            continue
        loc = locations.get(name)
        if loc is None:
            raise ValueError(f"{where}: the structure names tensor {name!r}, which the file does not hold")
        targets[name] = _Target(node, loc, where)
    extra = set(locations) - set(targets)
    if extra:
        raise ValueError(f"{where}: tensor {sorted(extra)[0]!r} is in the file but not in its structure "
                         "(tampered with?)")
    return targets


def _label(name, at, ambiguous):
    """name in a mismatch, and its place where it was matched by place."""
    return f"{name} (at state{''.join(f'[{k!r}]' for k in at.get(name, ()))})" if name in ambiguous else name


def _match_out(out, skeleton, targets, where):
    """{name: out tensor}, every one checked against the file before anything is read. Tensors are matched by
    name, except those save made unique with '#n' ("a.b" and "a.b#1": the dict key "a.b" next to a nested
    a -> b), which depend on the order of the places: those by place (keys and indices), so that out= listing
    them in another order than the saved state gets each its own values."""
    out_skeleton, entries = flatten(out, lenient=True)
    by_name = {e.name: e.original for e in entries}
    ambiguous = renamed(set(targets)) | renamed(set(by_name))
    given = {n: t for n, t in by_name.items() if n not in ambiguous}
    given_at = tensor_paths(out_skeleton)
    by_place = {given_at[n]: n for n in by_name if n in ambiguous}
    saved_at, placed = tensor_paths(skeleton), set()
    for name in ambiguous & set(targets):
        other = by_place.get(saved_at[name])
        if other is not None:
            given[name] = by_name[other]
            placed.add(other)
    missing = sorted(_label(n, saved_at, ambiguous) for n in set(targets) - set(given))
    unexpected = sorted(_label(n, given_at, ambiguous) for n in ambiguous & set(by_name) - placed)
    unexpected += sorted(set(given) - set(targets))
    if missing or unexpected:
        raise ValueError(f"{where}: out= does not match the checkpoint: "
                         + (f"missing {missing[:5]} " if missing else "")
                         + (f"unexpected {unexpected[:5]}" if unexpected else ""))
    for name, t in given.items():
        tg = targets[name]
        if tuple(t.shape) != tg.shape or t.dtype != tg.dtype:
            raise ValueError(f"{where}: tensor {name!r} is {tg.dtype} {list(tg.shape)} in the file, out= has "
                             f"{t.dtype} {list(t.shape)}")
    _check_writable(given, where)
    return given


def _span(t):
    """(device, first byte, end byte) of the memory t's elements occupy."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.device, t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlaps_itself(t):
    """True when two elements of t may share memory (an expand()ed tensor, stride 0, an as_strided overlap)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    reach = 0  # the farthest element offset the smaller-stride dimensions reach
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def _check_writable(given, where):
    """Every out= tensor can take its bytes: its values are its memory (no lazy conj/neg view), its storage holds
    it, a CPU tensor's memory is writable (a read-only np.memmap would crash a copy into it), none overlaps itself
    and no two (under different names) share memory. Checked before a byte is written."""
    spans = []
    for name, t in given.items():
        if t.numel() == 0:
            continue
        copied = detached.message_of(t)
        if copied is not None:
            raise ValueError(f"{where}: out= tensor {name!r} is {copied}")
        if t.is_conj() or t.is_neg():
            raise ValueError(f"{where}: out= tensor {name!r} is a lazily conjugated or negated view: loading into "
                             "it would store other values; pass a tensor of its own")
        _, start, end = _span(t)
        held = t.untyped_storage().nbytes()
        if storage_bytes_needed(t) > held:
            raise ValueError(f"{where}: out= tensor {name!r} reaches past its storage ({held} bytes; was the "
                             "storage resized or released?)")
        if t.device.type == "cpu" and not _C.writable(start, end - start):
            raise ValueError(f"{where}: out= tensor {name!r} is in memory this process cannot write (a read-only "
                             "mapping, such as a read-only np.memmap)")
        if _overlaps_itself(t):
            raise ValueError(f"{where}: out= tensor {name!r} has elements sharing memory (an expand()ed view, "
                             f"strides {list(t.stride())}): it cannot be loaded into; pass a tensor of its own")
        spans.append((*_span(t), name))
    spans.sort(key=lambda x: (str(x[0]), x[1]))
    for (dev_a, _, end_a, name_a), (dev_b, start_b, _, name_b) in zip(spans, spans[1:]):
        if dev_a == dev_b and start_b < end_a:
            raise ValueError(f"{where}: out= tensors {name_a!r} and {name_b!r} share memory: loading into both "
                             "would overwrite one with the other; pass tensors of their own")


def _runs(pairs, gap=RUN_GAP):
    """pairs split into runs of tensors close together in one file: read_into reads everything between the first
    and the last tensor it is given, and the bytes between two streamed tensors may be a big tensor already read
    directly."""
    runs = []
    for loc, view in sorted(pairs, key=lambda p: (p[0].path, p[0].offset)):
        last = runs[-1][-1][0] if runs else None
        if last is not None and last.path == loc.path and loc.offset - (last.offset + last.nbytes) <= gap:
            runs[-1].append((loc, view))
        else:
            runs.append([(loc, view)])
    return runs


def _direct(loc, t):
    """True when t (contiguous) takes its bytes by its own O_DIRECT request: a big CPU tensor (see the module)."""
    return t.device.type == "cpu" and loc.nbytes >= DIRECT_MIN


def device_of(device):
    """load's device as a torch.device; a RuntimeError saying so when it is CUDA and this torch has none."""
    return cuda_copy.usable_device(device, "swapio.checkpoint.load")


def _open(opened):
    """(skeleton, {name: _Target}, the file named in errors) of an opened checkpoint, its structure checked."""
    skeleton, where = skeleton_of(opened)
    return skeleton, _targets(skeleton, opened, where), where


def locate(path):
    """The structure saved in the file `path` with each tensor's Location (file, offset, bytes, dtype, shape) in
    its place ({name: Location} for a file swapio did not write): the header and structure checked as load()
    checks them, nothing else read. For readers that stream the bytes themselves (swapio.optim.checkpoint)."""
    skeleton, targets, _ = _open(open_checkpoint(path))
    return unflatten(skeleton, {name: tg.loc for name, tg in targets.items()})


def read_state(opened, *, device="cpu", out=None, staging_bytes=DEFAULT_STAGING, handle=None):
    """The state held by `opened` (swapio.safetensors.open_checkpoint's; see the module). out: a structure holding
    a tensor for every tensor of the checkpoint (same names; e.g. what state_dict() returns), filled in place; the
    returned structure then holds those tensors (and the saved non-tensor values)."""
    device = device_of(device)
    skeleton, targets, where = _open(opened)
    given = _match_out(out, skeleton, targets, where) if out is not None else None
    tensors, pairs, after, direct = {}, [], [], []
    for name, tg in targets.items():
        if given is not None:
            t = given[name]
            if t.is_contiguous() and _direct(tg.loc, t):
                dest = t.detach()
                direct.append((tg.loc, tg.byte_view(dest)))
                tensors[name] = t
                if not t.is_inference():  # the read writes t in place, as copy_ would: autograd and the
                    torch.autograd.graph.increment_version(t)  # offloaded optimizers' adoption must see it
                continue
            if t.is_contiguous():
                dest = t.detach()
            else:  # read contiguously, then copied into place (one tensor's worth)
                dest = torch.empty(tg.shape, dtype=tg.dtype, device=t.device)
                after.append((t, dest))
        else:
            if device.type == "cpu" and tg.stride is None and tg.loc.nbytes >= DIRECT_MIN:
                dest = torch.empty(tg.shape, dtype=tg.dtype)
                direct.append((tg.loc, tg.byte_view(dest)))
                tensors[name] = dest
                continue
            with cuda_copy.allocating_on_side_stream(device):
                dest = torch.empty(tg.shape, dtype=tg.dtype, device=device)
            t = dest
            if tg.stride is not None:
                t = torch.empty_strided(tg.shape, tg.stride, dtype=tg.dtype, device=device)
                after.append((t, dest))
        tensors[name] = t
        pairs.append((tg.loc, tg.byte_view(dest), dest.device))
    with buffers.handle_for(handle) as h:
        futures, in_flight = [], InFlight()
        try:
            # staged unless in swapio's pinned (huge-page) memory (see the module)
            for loc, view in direct:
                futures.append(in_flight.submit(
                    lambda: h.pread(view, loc.io_path, loc.offset, identity=loc.identity, staged="auto")))
            for dev in {d for _, _, d in pairs}:  # read_into streams to one device at a time
                for run in _runs([(loc, view) for loc, view, d in pairs if d == dev]):
                    span = run[-1][0].offset + run[-1][0].nbytes - run[0][0].offset
                    read_into(run, dev, handle=h,
                              staging_bytes=min(staging_bytes, 2 * round_up(span + ALIGN)))
        except BaseException:
            wait_all(futures)  # every read waited for after a failure too: none may go on writing into the tensors
            raise
        error = wait_all(futures)
        if error is not None:
            raise error
    check_unchanged(tg.loc for tg in targets.values())  # (before the copies into strided out= tensors)
    with torch.no_grad():
        for t, dest in after:
            # an inference tensor (a model built under inference_mode) takes the copy as the direct reads above
            # fill the contiguous ones: outside inference mode torch refuses it, after writing
            with torch.inference_mode(t.is_inference()):
                copyable(t).copy_(copyable(dest))
    if given is None:  # (out= tensors are the caller's, returned as they are)
        tensors = {name: targets[name].wrap(t) for name, t in tensors.items()}
    return unflatten(skeleton, tensors)
