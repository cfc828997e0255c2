"""The pieces of swapio.offload on their own: the pinned ring, span layout, order prediction, the safetensors
header reader (against the safetensors library's own view of the file)."""
import json

import pytest
import torch

from swapio.offload.layout import ALIGN, MERGE_GAP, Record, place_on_disk
from swapio.offload.ring import PinnedRing
from swapio.safetensors import open_checkpoint
from swapio.offload.schedule import Schedule
from swapio.offload.units import Slot

safetensors = pytest.importorskip("safetensors")
safetensors_torch = pytest.importorskip("safetensors.torch")


def test_ring_is_used_round_robin_and_coalesces_out_of_order_frees():
    ring = PinnedRing(10 * ALIGN)
    a = ring.alloc(3 * ALIGN)
    b = ring.alloc(3 * ALIGN)
    c = ring.alloc(3 * ALIGN)
    assert [x[0] for x in (a, b, c)] == [0, 3 * ALIGN, 6 * ALIGN]
    assert ring.alloc(2 * ALIGN) is None           # one page left
    ring.free(a[0], 3 * ALIGN)
    d = ring.alloc(ALIGN + 1)                       # rounded up to 2 pages, wraps to the start
    assert d[0] == 0 and d[1].numel() == 2 * ALIGN
    ring.free(c[0], 3 * ALIGN)                      # out of order: merges with the free last page
    e = ring.alloc(4 * ALIGN)
    assert e[0] == 6 * ALIGN
    for start, n in ((b[0], 3 * ALIGN), (d[0], ALIGN + 1), (e[0], 4 * ALIGN)):
        ring.free(start, n)
    assert ring.in_use == 0 and ring.alloc(10 * ALIGN)[0] == 0  # everything coalesced back into one extent
    assert ring.arena.data_ptr() % ALIGN == 0


def _slot(i, nbytes):
    s = Slot(i, f"t{i}", torch.empty(nbytes, dtype=torch.uint8, device="meta"), True)
    return s


def test_spans_merge_close_ranges_and_round_to_whole_pages():
    slots = [_slot(i, n) for i, n in enumerate((100, 5000, 10, 7))]
    record = Record(0, slots, [])
    locations = {slots[0]: ("f", 10, 100), slots[1]: ("f", 200, 5000),         # close: one span
                 slots[2]: ("f", 200 + 5000 + MERGE_GAP + 1, 10),                # far: its own span
                 slots[3]: ("g", 8190, 7)}                                       # another file, near its end
    place_on_disk([record], locations, {"f": 1 << 30, "g": 8197})
    assert record.spans == [("f", 0, 8192, 0), ("f", 266240, 4096, 8192), ("g", 4096, 4101, 12288)]
    assert [record.offsets[s] for s in slots] == [10, 200, 8192 + 5200 + MERGE_GAP + 1 - 266240, 12288 + 4094]
    assert record.nbytes == 12288 + 8192


def _copy_like_the_fetcher(record, host):
    """What Fetcher._copy_to_device does, with a CPU tensor standing in for the device copy."""
    offsets, nbytes, runs = record.device_layout()
    device = torch.full((nbytes,), 0xEE, dtype=torch.uint8)
    for h, d, length in runs:
        device[d:d + length].copy_(host[h:h + length])
    return offsets, device, runs


def test_device_copies_put_every_tensor_at_a_256_byte_boundary():
    # a safetensors checkpoint packs tensors back to back after its header: offsets like 168, 184...
    sizes = (168, 4 * 4096, 2 * 768, 6, 4 * 50257)
    slots = [_slot(i, n) for i, n in enumerate(sizes)]
    record = Record(0, slots, [])
    locations, at = {}, 8 + 160
    for s in slots:
        locations[s] = ("f", at, s.nbytes)
        at += s.nbytes
    place_on_disk([record], locations, {"f": at})
    host = torch.randint(0, 256, (record.nbytes,), dtype=torch.uint8)
    offsets, device, runs = _copy_like_the_fetcher(record, host)
    for s in slots:
        assert offsets[s] % 256 == 0
        assert torch.equal(device[offsets[s]:offsets[s] + s.nbytes], host[record.offsets[s]:record.offsets[s] + s.nbytes])
    spans = sorted((offsets[s], offsets[s] + s.nbytes) for s in slots)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tensors share device bytes


def test_device_copy_of_an_aligned_layout_is_one_run_and_follows_a_new_layout():
    from swapio.offload.layout import pack
    slots = [_slot(i, n) for i, n in enumerate((4096, 512, 1024 * 3))]
    record = Record(0, slots, [])
    locations = {s: ("f", 4096 * (i + 1), s.nbytes) for i, s in enumerate(slots)}  # page-aligned in the file
    place_on_disk([record], locations, {"f": 1 << 20})
    assert len(record.device_layout()[2]) == 1  # aligned already: one copy, as before
    pack([record])  # moved (training's offload_dir): laid out anew, and the device layout follows
    host = torch.randint(0, 256, (record.nbytes,), dtype=torch.uint8)
    offsets, device, _ = _copy_like_the_fetcher(record, host)
    for s in slots:
        assert offsets[s] % 256 == 0
        assert torch.equal(device[offsets[s]:offsets[s] + s.nbytes], host[record.offsets[s]:record.offsets[s] + s.nbytes])


def test_schedule_learns_the_order_units_run_in():
    units = ["a", "b", "c", "d"]
    s = Schedule(units)
    assert list(s.ahead("a"))[:2] == ["b", "c"] and list(s.ahead("d"))[:1] == ["a"]  # registration order, wrapping
    for u in ("d", "c", "b", "a"):
        s.observe(u)
    assert list(s.ahead("d")) == ["c", "b", "a"]
    assert list(s.behind("a"))[:2] == ["b", "c"]
    assert list(s.ahead("a")) == ["d", "c", "b"]  # after the last unit: the unit the first forward started with
    s.observe("d")
    assert list(s.ahead("a")) == ["d", "c", "b"]  # a cycle stops before coming back


def test_schedule_guesses_units_that_never_ran_before_units_that_ran():
    """The first forward of a layer that registers its norm last but runs it first: from the norm on, the walk
    goes through the layer's projections (never ran yet) before anything that already ran."""
    s = Schedule(["emb", "q", "o", "norm", "q2", "o2", "norm2", "head"])
    for u in ("emb", "norm"):
        s.observe(u)
    assert list(s.ahead("norm")) == ["q", "o", "q2", "o2", "norm2", "head", "emb"]
    for u in ("q", "o", "norm2"):
        s.observe(u)
    assert list(s.ahead("norm2")) == ["q2", "o2", "head", "emb", "norm", "q", "o"]


def test_header_reader_agrees_with_safetensors(tmp_path):
    tensors = {"z": torch.randn(3, 5), "a": torch.arange(7, dtype=torch.int16), "m": torch.ones(2, 2).bfloat16(),
               "empty": torch.empty(0, 4), "b": torch.tensor([True, False])}
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})
    locations = open_checkpoint(path)
    raw = path.read_bytes()
    assert set(locations) == set(tensors)
    with safetensors.safe_open(str(path), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            loc = locations[name]
            assert loc.dtype == t.dtype and loc.shape == tuple(t.shape) and loc.nbytes == t.numel() * t.element_size()
            mine = torch.frombuffer(bytearray(raw[loc.offset:loc.offset + loc.nbytes]), dtype=torch.uint8) \
                if loc.nbytes else torch.empty(0, dtype=torch.uint8)
            assert torch.equal(mine, t.contiguous().view(-1).view(torch.uint8))


def test_header_with_inconsistent_offsets_is_rejected(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ValueError, match=r"x.safetensors: tensor 'w' spans bytes \[0, 12\) but shape \[4\]"):
        open_checkpoint(path)
