"""cpu_offload, cpu_offload_with_hook, disk_offload, remove_offload: accelerate's names and arguments."""
import itertools
import os

import torch

from ..core._errors import check_bool, check_int, check_progress
from ..core.cuda_copy import normalize_device
from ..core.handle import AioHandle, check_moves_data
from ..core.pinned import empty_pinned
from . import dir_owner, dora, grafting, hf_decode, hf_generate, hf_resize, hf_save, preload, renorm, source
from . import offload_dir as odir
from .chain import CpuOffloadHook
from .streamer import WeightStreamer
from .weight_store import DiskStore, HostStore
from .fetch import ZERO_STATS, Fetcher
from .layout import group_records, pack, place_on_disk
from .hf_checkpoint_names import as_model_names
from .names import checkpoint_names, find
from .wrappers import under_model_names
from .data_parallel import refuse_wrapped
from .prepare import buffer_owners_outside, compute_buffers, computed_parameters, retie
from ..safetensors.files import check_unchanged as check_file_unchanged, wait_checked
from ..safetensors.opened import check_against, open_checkpoint
from .state_dict import assign_state_dict
from .registry import offloaded as _offloaded, register as _register, unregister as _unregister
from .units import check_unchanged, collect, get_entry, set_entry, table_of, trainable_modules




def _check_model(model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for m in model.modules():
        if m in _offloaded:
            raise ValueError("this model (or a submodule of it) is already offloaded by swapio; call "
                             "remove_offload(model) first")
        if hasattr(m, "_hf_hook"):
            raise ValueError("this model has accelerate hooks (_hf_hook); remove them "
                             "(accelerate.hooks.remove_hook_from_submodules) before offloading with swapio")


def _attach(model, streamer, original, preload_names=()):
    """Attaches the streamer (with preload_module_classes' wrappers and the watch for wrappers added later) and
    registers the model; on any failure, Ctrl-C included, the model is left as it was (no wrappers, original(slot)
    in every offloaded attribute) and the streamer closed, so that remove_offload's "not offloaded" is true and
    offloading again starts clean."""
    try:
        streamer.attach()
        preload.attach(streamer, preload_names)
        grafting.watch(streamer)
        _register(model, streamer)
    except BaseException:
        _unregister(model, streamer)
        streamer.detach()
        _put_back(streamer.units, original)
        streamer.close()
        raise


def _put_back(units, original):
    values = {}
    for unit in units:
        for attr, kind, slot in unit.entries:
            if slot not in values:
                values[slot] = original(slot)
            set_entry(unit.module, attr, kind, values[slot])


def _check_available(execution_device):
    """A clear error for a CUDA execution device on a machine without one (torch raises a bare AssertionError)."""
    if isinstance(execution_device, int) and not isinstance(execution_device, bool):
        device = torch.device("cuda", execution_device)
    elif isinstance(execution_device, (str, torch.device)):
        try:
            device = torch.device(execution_device)
        except RuntimeError as exc:  # torch's message lists every device type, without the argument's name
            raise ValueError(f"execution_device={execution_device!r} is not a device: use 'cpu', 'cuda' or "
                             "'cuda:<index>'") from exc
    else:
        return  # normalize_device reports the type
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"execution_device={execution_device!r}: offloaded weights are computed on 'cpu' or a "
                         f"CUDA device, not {device.type!r}")
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise RuntimeError(f"execution_device={execution_device!r} needs CUDA, but {why}; use "
                           "execution_device='cpu' (or leave it out)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"execution_device={execution_device!r}, but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")


def _execution_device(model, execution_device):
    if execution_device is not None:
        _check_available(execution_device)
        return normalize_device(execution_device)
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type != "meta":
            return normalize_device(t.device)
    return torch.device("cpu")


def _check_keep(keep_resident):
    if isinstance(keep_resident, str):
        return [keep_resident]
    try:
        keep = list(keep_resident)
    except TypeError:
        raise TypeError(f"keep_resident must be module names (a str or an iterable of them), got "
                        f"{type(keep_resident).__name__}") from None
    for k in keep:
        if not isinstance(k, str):
            raise TypeError(f"keep_resident must hold module names (str), got {type(k).__name__}")
    return keep


def _current(units):
    """slot -> the model's tensor for it now (before placeholders are installed)."""
    out = {}
    for unit in units:
        for attr, kind, slot in unit.entries:
            out.setdefault(slot, get_entry(unit.module, attr, kind))
    return out


def _read_tensor(handle, loc, device):
    t = torch.empty(loc.shape, dtype=loc.dtype)
    if loc.nbytes:
        read = handle.pread(t.view(-1).view(torch.uint8), loc.io_path, loc.offset, identity=loc.identity,
                            staged="auto")
        wait_checked([read], lambda: check_file_unchanged([loc]))  # written in place since: said, not used
    return t.to(device)


def _place_resident(resident, device, locations=None, handle=None, origin=None):
    """Resident tensors go to the execution device; those on meta are read from `locations` (by name)."""
    done = {}
    for module, attr, kind, name in resident:
        table = table_of(module, kind)
        t = table[attr]
        if id(t) in done:
            table[attr] = done[id(t)]
            continue
        if t.device.type == "meta":
            loc = find(locations, name) if locations is not None else None
            if loc is None:
                where = f"{origin} does not hold its values" if origin else "no checkpoint holds its values"
                raise ValueError(f"{name} stays resident but is on the meta device, and {where}: "
                                 f"{_meta_hint(module, attr, kind)}")
            loc = check_against(locations, checkpoint_names([name]), t.shape, t.dtype, origin)
            value = _read_tensor(handle, loc, device)
            new = torch.nn.Parameter(value, requires_grad=t.requires_grad) if kind == "param" else value
            table[attr] = new
        elif t.device != device:
            t.data = t.data.to(device)  # keeps the object: optimizers and references stay valid
            new = t
        else:
            new = t
        done[id(t)] = new


def _meta_hint(module, attr, kind):
    """Why a resident tensor is on meta, and what to do about it."""
    if kind == "param" and module._parameters[attr].requires_grad:
        return ("it is a trainable parameter that was created on meta (peft creates adapters on the device of the "
                "base weights, meta in a model built on meta): call get_peft_model after disk_offload instead, "
                "which creates them real, or build the model with its weights")
    if kind == "buffer" and attr in module._non_persistent_buffers_set:
        return ("it is a non-persistent buffer (computed in the constructor, never saved in checkpoints) that swapio "
                "could not compute again (it can for transformers models). Build the model with "
                "accelerate.init_empty_weights(), which leaves buffers real, or give the buffer its value before "
                "offloading")
    return ("build the model with its weights, or pass a checkpoint that holds this tensor, or keep it out of "
            "keep_resident")


def _check_path(name, path):
    """The path argument as given (an opened checkpoint is path-like and carries its parse), a bytes path as str
    (open() takes both), or a TypeError naming the argument."""
    try:
        fs = os.fspath(path)
    except TypeError:
        raise TypeError(f"{name} must be a path (str, bytes or os.PathLike), got {type(path).__name__}") from None
    if not fs:  # (offload_dir="" wrote the weight files into the current directory)
        raise ValueError(f"{name} is an empty path (for the current directory, pass '.')")
    return os.fsdecode(fs) if isinstance(fs, bytes) else path


def _check_common(prefetch, offload_buffers):
    prefetch = check_int("prefetch", prefetch, 0)
    return prefetch, check_bool("offload_buffers", offload_buffers, "a bool")


def cpu_offload(model, execution_device=None, offload_buffers=False, state_dict=None, preload_module_classes=None, *,
                prefetch=1, keep_resident=()):
    """Keeps the weights in host memory (pinned when the execution device is a GPU); each submodule's weights
    reach `execution_device` right before its forward and are dropped after it, with the next `prefetch`
    submodules' copies already in flight. `state_dict` (accelerate's argument): the weights to use instead of the
    model's own (the model may be on meta). `preload_module_classes`: class names of modules that get all their
    submodules' weights at the start of their forward. Returns the model."""
    _check_model(model)
    refuse_wrapped(model)
    prefetch, offload_buffers = _check_common(prefetch, offload_buffers)
    preload_names = preload.check(preload_module_classes)
    device = _execution_device(model, execution_device)
    if state_dict is not None:  # a model built on meta: what disk_offload(checkpoint=) supplies, from the dict
        assign_state_dict(model, state_dict)
        state_dict = under_model_names(model, state_dict)  # a wrapped model's tensors under its own names too
        retie(model, state_dict)
        compute_buffers(model, state_dict)  # what it cannot compute stays on meta: _place_resident names it
    computed = computed_parameters(model, state_dict) if state_dict is not None else []  # never saved
    units, slots, resident = collect(model, offload_buffers,
                                     _check_keep(keep_resident) + trainable_modules(model) + computed)
    dora.check_offloaded(model, units, preload_names)
    renorm.check_offloaded(units)
    current = _current(units)
    for slot in slots:
        if current[slot].device.type == "meta":
            raise ValueError(f"cpu_offload needs the model's weights, but {slot.name} is on the meta device (use "
                             "disk_offload(model, checkpoint=...) for a model built on meta)")
    # On the CPU the model's own tensors are the host copies: copying them would hold the weights twice while
    # the originals stay alive, and a model loaded by from_pretrained keeps every original alive until the last
    # is dropped (its tensors are views of one mmap of the checkpoint): cpu_offload peaked at 1.8x resident.
    in_place = device.type == "cpu"
    records = group_records(units, per_tensor=in_place)
    pack(records)
    hosts, devices = {}, {slot: t.device for slot, t in current.items()}
    used_in_place = {}  # slot -> the model's own tensor, whose memory is its record's host copy

    def original(slot):  # the tensor as it was: still the model's own, or rebuilt from its host copy
        if slot in current:
            return current[slot]
        if slot in used_in_place:
            return used_in_place[slot]
        t = slot.record.view(hosts[slot.record], slot).to(devices[slot], copy=True)
        return torch.nn.Parameter(t, requires_grad=slot.requires_grad) if slot.is_param else t

    try:
        for record in records:  # one record at a time: at most one record exists twice
            own = _own_memory(current[record.slots[0]]) if in_place and len(record.slots) == 1 else None
            if own is not None:
                host = own
                used_in_place[record.slots[0]] = current[record.slots[0]]
            elif device.type == "cuda":
                host = empty_pinned(record.nbytes, torch.uint8)
            else:
                host = torch.empty(record.nbytes, dtype=torch.uint8)
            if own is None:
                for slot in record.slots:
                    record.view(host, slot, writable=True).copy_(current[slot].detach())
            hosts[record] = host
            for slot in record.slots:  # the model's own copy goes now that the host copy is complete
                for unit in record.units:
                    for attr, kind, s in unit.entries:
                        if s is slot:
                            set_entry(unit.module, attr, kind, slot.placeholder)
                del current[slot]
        _place_resident(resident, device)
        fetcher = Fetcher(records, device, hosts=hosts)
        streamer = WeightStreamer(model, units, slots, records, fetcher, device, prefetch, HostStore(fetcher),
                                  dressings=(hf_save, hf_resize, hf_decode, hf_generate))
    except BaseException:
        _put_back(units, original)
        raise
    _attach(model, streamer, original, preload_names)
    return model


def _own_memory(t):
    """The tensor's bytes as a flat uint8 tensor sharing its memory, or None where that is not possible."""
    t = t.detach()
    if t.numel() == 0 or not t.is_contiguous() or t.device.type != "cpu":
        return None
    return t.reshape(-1).view(torch.uint8)


def cpu_offload_with_hook(model, execution_device=None, prev_module_hook=None):
    """Keeps the whole model in host memory until it runs; it then stays on `execution_device` until
    hook.offload() (called by the next model of a chain, through its prev_module_hook). Returns (model, hook)."""
    _check_model(model)
    device = _execution_device(model, execution_device)
    hook = CpuOffloadHook(model, device, prev_module_hook)
    try:
        _register(model, hook)
    except BaseException:
        _unregister(model, hook)
        hook.undo()
        raise
    hook.settle()
    return model, hook


def disk_offload(model, offload_dir=None, execution_device=None, offload_buffers=False, preload_module_classes=None, *,
                 checkpoint=None, prefetch=2, buffer_bytes=256 << 20, keep_resident=(), handle=None, progress=None):
    """Keeps the weights in files and streams each submodule's weights in just before its forward, with O_DIRECT
    reads into a ring of `buffer_bytes` of pinned memory, at least `prefetch` submodules ahead and as far as
    the ring holds (prefetch=0: no read-ahead). Exactly one of:
    offload_dir (the model's current weights are written there once, streamed), or checkpoint (a safetensors
    file, a directory with model.safetensors or a sharded index, read in place; the model may be on meta).
    `preload_module_classes`: class names of modules that get all their submodules' weights at the start of
    their forward (accelerate's argument). progress: a bar of the weights written to offload_dir, on stderr
    (None: only when stderr is a terminal or SWAPIO_PROGRESS=1; True/False: always/never; needs tqdm).
    Returns the model."""
    if offload_dir is None and checkpoint is None:
        raise ValueError("disk_offload needs offload_dir (write the model's weights there) or checkpoint (read "
                         "them from a safetensors checkpoint), or both (train weights read from a checkpoint: "
                         "offload_dir receives the trained ones)")
    _check_model(model)
    refuse_wrapped(model)
    offload_dir = None if offload_dir is None else _check_path("offload_dir", offload_dir)
    checkpoint = None if checkpoint is None else _check_path("checkpoint", checkpoint)
    progress = check_progress(progress)
    prefetch, offload_buffers = _check_common(prefetch, offload_buffers)
    buffer_bytes = check_int("buffer_bytes", buffer_bytes, 4096)
    preload_names = preload.check(preload_module_classes)
    if handle is not None and not isinstance(handle, AioHandle):
        raise TypeError(f"handle must be a swapio.AioHandle, got {type(handle).__name__}")
    check_moves_data(handle, "disk_offload")  # (None: its own, which SWAPIO_ENGINE may make null)
    device = _execution_device(model, execution_device)
    keep = _check_keep(keep_resident) + trainable_modules(model)
    names = None
    if checkpoint is not None:  # a model built on meta: its ties and computed buffers, which no checkpoint holds
        names = open_checkpoint(checkpoint)
        model_names = as_model_names(model, names)  # a transformers checkpoint's older names: the model's
        model_names = under_model_names(model, model_names)  # torch.compile's wrapped names too
        retie(model, model_names)
        compute_buffers(model, model_names)  # what it cannot compute stays on meta: _place_resident names it
        keep += computed_parameters(model, model_names)  # never saved: no checkpoint serves them
        if offload_buffers:
            keep += buffer_owners_outside(model, model_names)
    else:  # a model on meta reusing an offload_dir has its computed buffers on meta too
        compute_buffers(model, {})
    units, slots, resident = collect(model, offload_buffers, keep)
    dora.check_offloaded(model, units, preload_names)
    renorm.check_offloaded(units)
    records = group_records(units)
    own = handle is None
    handle = AioHandle() if own else handle
    dir_claim = None  # ours until remove_offload: a second model writing there would delete our data
    try:
        current = _current(units)
        origin, by_name = None, None
        if offload_dir is not None:
            offload_dir = os.path.abspath(os.fspath(offload_dir))
            dir_claim = dir_owner.claim(offload_dir)
            dir_owner.reclaim(offload_dir)
        if checkpoint is not None:
            origin, by_name = os.fspath(checkpoint), model_names  # the header read once
            if offload_dir is not None:
                dir_claim.source = _same_source(offload_dir, checkpoint, names)
            if offload_dir is not None and odir.has_index(offload_dir):
                by_name = {**model_names, **odir.read_index(offload_dir)}  # weights trained earlier, then the checkpoint
        elif any(t.device.type == "meta" for t in current.values()):
            if not odir.has_index(offload_dir):
                meta = next(s.name for s, t in current.items() if t.device.type == "meta")
                raise ValueError(f"{meta} is on the meta device and {os.fspath(offload_dir)} holds no swapio "
                                 "offload: pass checkpoint=..., or a model with its weights")
            origin, by_name = os.fspath(offload_dir), odir.read_index(offload_dir)
        writable = None
        if by_name is not None:
            locations = {s: check_against(by_name, checkpoint_names(s.names), s.shape, s.dtype, origin).as_tuple()
                         for s in slots}
            if offload_dir is not None and odir.has_index(offload_dir):
                writable = odir.data_path(offload_dir)
        else:
            pack(records)
            locations = odir.write(offload_dir, records, current.__getitem__, handle, claim=dir_claim,
                                   progress=progress)
            writable = next(iter(locations.values()))[0] if locations else None
        sizes = {path: os.path.getsize(path) for path in {loc[0] for loc in locations.values()}}
        place_on_disk(records, locations, sizes)
        _place_resident(resident, device, by_name, handle, origin)
        sources = {loc.path: loc for loc in (by_name or {}).values() if loc.source is not None}
        fetcher = Fetcher(records, device, handle=handle, buffer_bytes=buffer_bytes, sources=sources)
        store = DiskStore(records, fetcher, handle, dict(locations), offload_dir, dir_claim, writable)
        streamer = WeightStreamer(model, units, slots, records, fetcher, device, prefetch, store,
                                  dressings=(hf_save, hf_resize, hf_decode, hf_generate))
        if own:
            streamer.extra_close.append(handle.close)
        if dir_claim is not None:  # given up by remove_offload, or when the model is collected
            streamer.extra_close.append(dir_claim.release)
    except BaseException:
        if dir_claim is not None:
            dir_claim.release(remove_directory=dir_claim.created)
        if own:
            handle.close()
        raise
    _attach(model, streamer, current.__getitem__, preload_names)  # on failure, streamer.close() gives up handle, claim
    return model


def _same_source(offload_dir, checkpoint, names):
    """The checkpoint's fingerprint (source.py); ValueError when offload_dir holds weights trained from another."""
    mine = source.fingerprint(names)
    recorded = odir.recorded_source(offload_dir) if odir.has_index(offload_dir) else None
    if recorded is not None and recorded != mine:
        raise ValueError(f"offload_dir {offload_dir} holds weights trained from another checkpoint than "
                         f"{os.fspath(checkpoint)}, and would serve them instead of its weights: pass the checkpoint "
                         "they were trained from, or another (or an empty) offload_dir to start from this one")
    return mine


def remove_offload(model):
    """Puts an offloaded model back to normal, resident weights on its execution device (ties kept), and frees
    swapio's buffers and handles. Files in offload_dir and checkpoints are left in place."""
    owner = _offloaded.get(model) if isinstance(model, torch.nn.Module) else None
    if owner is None:
        raise ValueError("this model is not offloaded by swapio")
    if owner.model is not model:
        raise ValueError("remove_offload needs the model that was offloaded, not one of its submodules")
    if isinstance(owner, CpuOffloadHook):
        owner.remove()
        return model
    owner.begin_removal()  # refused while a forward runs (another thread's generate); new ones refused meanwhile
    try:
        owner.training.flush_owners()  # updates still running in backward: the weights come back as the last step left them
        check_unchanged(owner.units)  # a weight replaced, or changed in place and lost, is said before it goes resident
        resident = owner.materialize()  # on failure (a file that shrank, Ctrl-C) the model stays offloaded
    except BaseException:
        owner.end_removal()
        raise
    try:
        owner.install(resident)  # still wrapped: a call now would fetch and put the placeholders back
    finally:
        owner.detach()
        _unregister(model, owner)
        owner.close()
    return model


def stats(model, reset=False):
    """Counters of an offloaded model (since it was offloaded or last reset): reads, bytes_read, temp buffers,
    device copies, refetches (backward), and where its forwards' time went: forward_s (wall time of the
    outermost offloaded forwards), wait_s (of it, waiting for weights: reads not yet done, issuing device
    copies), compute_s (forward_s - wait_s), read_gbps (bytes_read per second of forward_s, GB/s).
    reset=True zeroes every counter after returning them. See docs/offload.md, "Seeing where time goes"."""
    reset = check_bool("reset", reset, "a bool")  # (reset="False" zeroed the counters)
    owner = _offloaded.get(model)
    if not isinstance(owner, WeightStreamer):
        raise ValueError("this model is not offloaded by swapio's cpu_offload or disk_offload")
    with owner.fetcher.lock:
        out = dict(owner.fetcher.stats, refetches=owner.saved.refetches)
        if reset:
            owner.fetcher.stats.update(ZERO_STATS)
            owner.saved.refetches = 0
    out["compute_s"] = max(0.0, out["forward_s"] - out["wait_s"])
    out["read_gbps"] = out["bytes_read"] / out["forward_s"] / 1e9 if out["forward_s"] > 0 else 0.0
    return out

