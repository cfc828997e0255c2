"""What save_checkpoint stores, and where each tensor's bytes come from.

The tensors are the model's state_dict, in its order, each stored once under its first name: a tied weight (one
Slot with several names, or one resident tensor reached from several modules) is dropped under its later names,
as save_pretrained drops tied duplicates; non-persistent buffers are not in state_dict, so not stored. An
offloaded tensor's bytes are read through the model's own fetcher (never from the offload files directly: the
fetcher knows where the current weights are, whoever rewrites them); a resident one comes from the model.
A stored tensor may also be a part of one: computed from a tensor's value by its Split (save_pretrained's
original layout, hf_original_layout.py), all the parts of one value from one reading of it.
"""
import torch

from ..core._signals import DeferredSigint
from ..safetensors.bytes_of import flat_bytes
from ..safetensors.layout import Entry
from .fetch import view


class Item:
    """One stored tensor: its Entry (name, shape, dtype, bytes) and either its Slot or its resident tensor; `part`
    (a Split, the name) when what is stored is Split(that value)[name] instead of the value itself."""

    __slots__ = ("entry", "slot", "tensor", "part")

    def __init__(self, entry, slot, tensor, part=None):
        self.entry, self.slot, self.tensor, self.part = entry, slot, tensor, part


class Split:
    """The tensors computed from one stored value (its parts): split(value) -> {name: tensor}, each checked
    against the Entry planned for it (the plan is made from shapes alone, before any value is read)."""

    __slots__ = ("compute", "entries")

    def __init__(self, compute, entries):
        self.compute, self.entries = compute, entries  # entries: {name: Entry}

    def __call__(self, value):
        parts = self.compute(value)
        for name, e in self.entries.items():
            t = parts.get(name)
            if t is None or tuple(t.shape) != tuple(e.tensor.shape) or t.dtype != e.tensor.dtype:
                got = "nothing" if t is None else f"{t.dtype} {list(t.shape)}"
                raise RuntimeError(f"{name}: computed from the model's value it is {got}, not the planned "
                                   f"{e.tensor.dtype} {list(e.tensor.shape)}")
        return parts


def _key(t):
    """Resident tensors that are the same view of the same memory are one tensor (a tie)."""
    if not t.numel():
        return ("id", id(t))
    return ("view", t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())


def items(model, streamer=None):
    """[Item] in state_dict order, each tensor once. TypeError for what safetensors cannot hold, ValueError for a
    tensor on meta that swapio does not stream (it has no value)."""
    by_name, by_id = {}, {}
    for slot in streamer.slots if streamer is not None else ():
        by_name.update((n, slot) for n in slot.names)
        by_id.update((id(t), slot) for t in (slot.placeholder, slot.stand_in) if t is not None)
    holders = {}  # slot index -> ids of the modules that hold it (a forward running in another thread: its fetched)
    for unit in streamer.units if streamer is not None else ():
        for _, _, slot in unit.entries:
            holders.setdefault(slot.index, set()).add(id(unit.module))
    modules = dict(model.named_modules(remove_duplicate=False))
    seen, out = set(), []
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict entry {name!r} is a {type(t).__name__} (a module's extra state), which a "
                            "safetensors checkpoint cannot hold")
        slot = by_id.get(id(t))
        named = by_name.get(name) if slot is None else None
        if named is not None and id(modules.get(name.rpartition(".")[0])) in holders[named.index]:
            slot = named  # under its name, in its own module: fetched there by a running forward
        # (else a module put in the offloaded one's place, `model.head = nn.Linear(...)`: its own tensor is saved)
        if slot is None and t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device and not offloaded by swapio: it has no value to save")
        key = ("slot", slot.index) if slot is not None else _key(t)
        if key in seen:
            continue
        seen.add(key)
        entry = Entry(name, slot.placeholder if slot is not None else t, name)
        if entry.raw:
            raise TypeError(f"{name} is {t.dtype}, which safetensors has no name for: other readers would see raw "
                            "bytes (cast it to a safetensors dtype first)")
        out.append(Item(entry, slot, None if slot is not None else t.detach()))
    return out


class Reader:
    """The bytes of each item, asked in file order (the streaming writer's sources: one at a time, each copied
    into staging before the next is asked). An offloaded tensor's record is acquired as materialize() does, the
    next `ahead` records of the file started meanwhile (as far as the ring has room), and released when the file
    moves on to another record: one record held at a time, whatever the model's size."""

    def __init__(self, streamer, items_in_file_order):
        self.fetcher = streamer.fetcher if streamer is not None else None
        self.ahead = max(2, streamer.prefetch) if streamer is not None else 0
        self.sequence = []  # the records in the order the file reaches them (zero-byte tensors are never asked)
        for it in items_in_file_order:
            record = it.slot.record if it.slot is not None and it.entry.nbytes else None
            if record is not None and (not self.sequence or self.sequence[-1] is not record):
                self.sequence.append(record)
        self.next, self.held = 0, None
        self.split, self.parts = None, None  # the Split whose parts were computed last, and them

    def source(self, item):
        """The callable the writer asks for the item's bytes (a 1-D uint8 tensor)."""
        if item.part is not None:
            return lambda: self._part(item)
        if item.slot is None:
            return lambda: flat_bytes(item.tensor)
        return lambda: flat_bytes(self._offloaded(item.slot))

    def _part(self, item):
        split, name = item.part
        if self.split is not split:  # the parts of one value are computed once while it is held
            value = item.tensor if item.slot is None else self._offloaded(item.slot)
            self.parts, self.split = split(value), split
        return flat_bytes(self.parts[name])

    def _offloaded(self, slot):
        """The slot's value, a view of its held record."""
        if self.held is None or self.held.record is not slot.record:
            self.release()
            while self.sequence[self.next] is not slot.record:
                self.next += 1
            self.next += 1
            for later in self.sequence[self.next:self.next + self.ahead]:
                if self.fetcher.start(later) is None:
                    break  # the ring is full: reads go on from here at the next record
            with DeferredSigint():  # a Ctrl-C lands once `held` names the fetch that release() gives back
                self.held = self.fetcher.acquire(slot.record)
        return view(self.held, slot)

    def release(self):
        self.split, self.parts = None, None  # they may be views of the held record
        held, self.held = self.held, None
        if held is not None:
            self.fetcher.release(held)
