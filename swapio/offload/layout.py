"""Records: the tensors fetched together, and where their bytes lie in memory and on disk.

Tensors used by exactly the same units form one record (for most modules: the module's own weight and bias; a
tied weight gets a record of its own, shared by the units that use it). A record is fetched as one region of
memory: on disk, its tensors' byte ranges are merged into spans read with single aligned requests (start rounded
down, end rounded up to 4 KiB, so each is one O_DIRECT request straight into a 4 KiB-aligned pinned region).
"""
import torch

from ..core._align import ALIGN, round_up
from ..safetensors.reader import read_end

TENSOR_ALIGN = 64      # tensors packed by swapio start at 64-byte boundaries, like torch's own allocations
DEVICE_ALIGN = 256     # on a GPU each tensor starts at a 256-byte boundary, as from torch's caching allocator:
                       # cuBLAS picks other (slower, differently rounding) kernels for less aligned operands
MERGE_GAP = 256 << 10  # byte ranges closer than this in one file are read as one span, gap included


def slot_view(buf, offset, slot, writable=False):
    """The slot's tensor at byte `offset` of a record's memory `buf` (uint8, host or device): a view, or a copy
    where the offset is misaligned for the slot's dtype (a checkpoint may put a tensor there; swapio packs its own
    records at TENSOR_ALIGN). writable=True: the caller writes the new value into it, so a copy is refused."""
    raw = buf[offset:offset + slot.nbytes]
    if offset % slot.dtype.itemsize == 0:
        return raw.view(slot.dtype).view(slot.shape)
    if writable:
        raise RuntimeError(f"the offloaded weight {slot.name!r} lies at byte {offset} of its record, misaligned for "
                           f"{slot.dtype}: its new value cannot be written in place")
    aligned = torch.empty(slot.shape, dtype=slot.dtype, device=raw.device)
    aligned.view(-1).view(torch.uint8).copy_(raw)
    return aligned


class Record:
    """Slots fetched together. `offsets`: slot -> byte offset in the record's region; `nbytes`: region size
    (a multiple of 4 KiB); `spans`: (path, file offset, length, region offset) to read, for disk records."""

    __slots__ = ("index", "slots", "units", "offsets", "nbytes", "spans", "_device")

    def __init__(self, index, slots, units):
        self.index, self.slots, self.units = index, slots, units
        self.offsets, self.nbytes, self.spans = {}, 0, []
        self._device = None

    def device_layout(self):
        """(offsets, nbytes, runs) of the record's copy on a GPU: every slot at a DEVICE_ALIGN boundary, and the
        host-to-device copies that put it there, runs of (host offset, device offset, length): one run for slots
        whose host offsets already keep that alignment. Computed once per layout of the record."""
        key = tuple(self.offsets[s] for s in self.slots)  # a record laid out anew (moved for training) changes it
        if self._device is None or self._device[0] != key:
            offsets, runs, end = {}, [], 0
            for slot in sorted(self.slots, key=lambda s: (self.offsets[s], -s.nbytes)):
                host = self.offsets[slot]
                if runs:  # the slot continues the last run (a shifted copy of host bytes) if aligned there
                    h0, d0, length = runs[-1]
                    at = d0 + host - h0
                    if at % DEVICE_ALIGN == 0:
                        offsets[slot] = at
                        runs[-1] = (h0, d0, max(length, host + slot.nbytes - h0))
                        end = max(end, at + slot.nbytes)
                        continue
                at = round_up(end, DEVICE_ALIGN)
                offsets[slot] = at
                runs.append((host, at, slot.nbytes))
                end = at + slot.nbytes
            self._device = (key, (offsets, max(end, 1), runs))
        return self._device[1]

    def view(self, buf, slot, writable=False):
        """The slot's tensor in `buf`, this record's host memory (see slot_view)."""
        return slot_view(buf, self.offsets[slot], slot, writable)

    def __repr__(self):
        return f"<Record {self.index}: {[s.name for s in self.slots]}, {self.nbytes} bytes>"


def group_records(units, per_tensor=False):
    """Records in the order units first use them; fills unit.records and slot.record. `per_tensor`: one record
    per tensor (cpu_offload on the CPU, where each record is the model's own tensor, not a packed copy)."""
    users = {}
    for unit in units:
        for _, _, slot in unit.entries:
            users.setdefault(slot, []).append(unit)
    records, by_users = [], {}
    for unit in units:
        for _, _, slot in unit.entries:
            if slot.record is not None:
                continue
            key = tuple(u.index for u in users[slot]) + ((slot.index,) if per_tensor else ())
            record = by_users.get(key)
            if record is None:
                record = by_users[key] = Record(len(records), [], users[slot])
                records.append(record)
            record.slots.append(slot)
            slot.record = record
    for unit in units:
        for _, _, slot in unit.entries:
            if slot.record not in unit.records:
                unit.records.append(slot.record)
    return records


def pack(records):
    """Packed layout (swapio's own files and host copies): each tensor at a 64-byte boundary."""
    for record in records:
        end = 0
        for slot in record.slots:
            end = round_up(end, TENSOR_ALIGN)
            record.offsets[slot] = end
            end += slot.nbytes
        record.nbytes = round_up(max(end, 1))


def place_on_disk(records, locations, file_sizes):
    """Read layout from where each slot's bytes are: locations[slot] = (path, offset, nbytes)."""
    for record in records:
        ranges = sorted((locations[s][0], locations[s][1], locations[s][1] + locations[s][2], s)
                        for s in record.slots)
        spans, record.offsets, region = [], {}, 0
        i = 0
        while i < len(ranges):
            path, start, end, _ = ranges[i]
            j = i + 1
            while j < len(ranges) and ranges[j][0] == path and ranges[j][1] - end <= MERGE_GAP:
                end = max(end, ranges[j][2])
                j += 1
            first = start // ALIGN * ALIGN
            last = read_end(end, file_sizes[path])
            for _, offset, _, slot in ranges[i:j]:
                record.offsets[slot] = region + offset - first
            spans.append((path, first, last - first, region))
            region += round_up(last - first)
            i = j
        record.spans = spans
        record.nbytes = max(region, ALIGN)
