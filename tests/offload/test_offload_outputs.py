"""Offloaded models compute exactly what the resident model computes (CPU execution): logits and generate()
token ids of a GPT-2, from offload_dir, from safetensors checkpoints (single, sharded, plain file) and from
pinned host memory; remove_offload gives a normal model back."""
import json
import os

import pytest
import torch

import swapio
from swapio.offload import cpu_offload, disk_offload, remove_offload, stats
from swapio.offload.api import _offloaded
from helpers.offload import assert_same_outputs, meta_model, reference, resident_model

safetensors_torch = pytest.importorskip("safetensors.torch")


def engine_of(model):
    return _offloaded[model]


@pytest.mark.parametrize("buffer_bytes", [256 << 20, 64 << 10], ids=["ring", "tiny-ring"])
def test_disk_offload_to_offload_dir_matches_resident(tmp_path, buffer_bytes):
    model = disk_offload(resident_model(), tmp_path / "od", buffer_bytes=buffer_bytes)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing resident between forwards
    assert_same_outputs(model)
    remove_offload(model)


def test_offload_dir_records_are_single_aligned_reads(tmp_path):
    model = disk_offload(resident_model(), tmp_path / "od")
    engine = engine_of(model)
    for record in engine.records:
        assert len(record.spans) == 1
        path, offset, length, region_offset = record.spans[0]
        assert offset % 4096 == 0 and length % 4096 == 0 and region_offset == 0
    with torch.no_grad():
        model(reference()[0])  # the first forward also starts reading the next one's first records
        before = stats(model)["reads"]
        model(reference()[0])
    per_forward = stats(model)["reads"] - before
    # every record once per forward, but the tied wte/lm_head one: it stays in the spare buffer, read once
    assert per_forward == len(engine.records) - 1
    remove_offload(model)


def test_tied_weights_are_stored_once(tmp_path):
    model = resident_model()
    unique = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    disk_offload(model, tmp_path / "od")
    index = json.loads((tmp_path / "od" / "swapio-weights.json").read_text())
    assert "lm_head.weight" not in index["tensors"]
    assert index["tensors"]["transformer.wte.weight"]["names"] == ["transformer.wte.weight", "lm_head.weight"]
    data = tmp_path / "od" / index["data"]
    assert os.path.getsize(data) < sum(unique.values()) + 4096 * (len(unique) + 1)
    remove_offload(model)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_disk_offload_from_save_pretrained_checkpoint_on_meta(tmp_path):
    resident_model().save_pretrained(tmp_path / "ck")
    model = disk_offload(meta_model(), checkpoint=tmp_path / "ck")
    assert_same_outputs(model)
    remove_offload(model)
    assert_same_outputs(model)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("point_at", ["directory", "index"])
def test_disk_offload_from_sharded_checkpoint(tmp_path, point_at):
    resident_model().save_pretrained(tmp_path / "ck", max_shard_size="100KB")
    shards = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "ck" / "model.safetensors.index.json").exists()
    target = tmp_path / "ck" if point_at == "directory" else tmp_path / "ck" / "model.safetensors.index.json"
    model = disk_offload(meta_model(), checkpoint=target, buffer_bytes=1 << 20)
    assert_same_outputs(model)


def test_disk_offload_from_plain_safetensors_file(tmp_path):
    safetensors_torch.save_model(resident_model(), str(tmp_path / "w.safetensors"))
    model = disk_offload(meta_model(), checkpoint=tmp_path / "w.safetensors")
    assert_same_outputs(model)


def test_disk_offload_reuses_its_offload_dir_for_a_meta_model(tmp_path):
    remove_offload(disk_offload(resident_model(), tmp_path / "od"))
    model = disk_offload(meta_model(), tmp_path / "od")
    assert_same_outputs(model)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_cpu_offload_matches_resident(prefetch):
    model = cpu_offload(resident_model(), prefetch=prefetch)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert_same_outputs(model)
    remove_offload(model)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_same_outputs(model)


def test_remove_offload_then_offload_again(tmp_path):
    model = resident_model()
    remove_offload(disk_offload(model, tmp_path / "a"))
    assert not any(p.device.type == "meta" for p in model.parameters())
    disk_offload(model, tmp_path / "b")
    assert_same_outputs(model)
    remove_offload(model)


class _Norms(torch.nn.Module):
    """Buffers (BatchNorm running statistics) and a module that runs twice per forward."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.inp = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.bn.running_mean.copy_(torch.randn(16, generator=g))
        self.bn.running_var.copy_(torch.rand(16, generator=g) + 0.5)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.shared(torch.relu(self.shared(self.bn(self.inp(x))))))


@pytest.mark.parametrize("offload_buffers", [False, True])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_buffers_follow_offload_buffers(tmp_path, kind, offload_buffers):
    torch.manual_seed(0)
    model = _Norms().eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = model(x)
    if kind == "cpu":
        cpu_offload(model, offload_buffers=offload_buffers)
    else:
        disk_offload(model, tmp_path / "od", offload_buffers=offload_buffers, buffer_bytes=8192)
    assert (model.bn.running_mean.device.type == "meta") == offload_buffers
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(model(x), want)
    remove_offload(model)
    assert model.bn.running_mean.device.type == "cpu"


class _Reversed(torch.nn.Module):
    """Modules registered in one order and run in the opposite one; the first returns a view of its weight."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))
        self.table = torch.nn.Embedding(10, 32)

    def forward(self, x):
        h = x + self.table.weight[:1]  # a parent reading a child's weight is not supported: not done here
        for layer in reversed(self.layers):
            h = torch.tanh(layer(h))
        return h


class _ViewOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 32))

    def forward(self, n):
        return self.weight[:n]  # a view of the weight escapes the module


def test_learned_order_and_escaping_views(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.pos = _ViewOut()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))

    def forward(x):
        h = x + model.pos(2)
        for layer in reversed(model.layers):
            h = torch.tanh(layer(h))
        return h
    x = torch.randn(2, 32)
    with torch.no_grad():
        want = forward(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=8192, prefetch=2)  # the ring holds about two layers
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(forward(x), want)
        before = stats(model)["reads"]
        assert torch.equal(forward(x), want)
    assert stats(model)["reads"] - before == 7  # the learned order wastes no prefetch
    assert stats(model)["temp"] == 0


def test_keep_resident_modules_stay_in_memory(tmp_path):
    model = resident_model()
    head = model.transformer.h[1]
    disk_offload(model, tmp_path / "od", keep_resident=["transformer.h.1"])
    assert all(p.device.type == "cpu" for p in head.parameters())
    assert model.transformer.h[0].attn.c_attn.weight.device.type == "meta"
    assert_same_outputs(model)


@pytest.mark.parametrize("staging_bytes", [8192, 128 << 20], ids=["tensors-span-windows", "default"])
def test_load_file_matches_safetensors(tmp_path, staging_bytes):
    resident_model().save_pretrained(tmp_path / "ck", max_shard_size="100KB")
    mine = swapio.offload.load_file(tmp_path / "ck", staging_bytes=staging_bytes)
    theirs = {}
    for name in os.listdir(tmp_path / "ck"):
        if name.endswith(".safetensors"):
            theirs.update(safetensors_torch.load_file(str(tmp_path / "ck" / name)))
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k
