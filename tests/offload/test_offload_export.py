"""swapio.offload.save_checkpoint: an offloaded (or plain) model's current weights as a safetensors file or the
sharded directory save_pretrained writes; every tensor byte-exact, ties stored once; transformers, safetensors and
disk_offload(checkpoint=...) read it; a failure mid-write leaves a previous export whole and no debris."""
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from helpers.offload import assert_same_outputs, meta_model, one_thread, reference, resident_model, transformers
from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint, stats
from swapio.offload import export_tensors
from swapio.offload.api import _offloaded
from swapio.checkpoint import DEFAULT_STAGING
from swapio.offload.export import shard_size
from helpers.rss_child import PRELUDE

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402


def offloaded(how, tmp_path):
    """The tiny GPT-2 (tied lm_head / wte), offloaded `how`."""
    if how == "offload_dir":
        return disk_offload(resident_model(), tmp_path / "od", buffer_bytes=64 << 10)
    if how == "offload_dir+resident":  # resident modules and offloaded buffers mixed in
        return disk_offload(resident_model(), tmp_path / "od", keep_resident=["transformer.h.0"], offload_buffers=True)
    if how == "checkpoint":
        resident_model().save_pretrained(tmp_path / "ck")
        return disk_offload(meta_model(), checkpoint=tmp_path / "ck")
    if how == "cpu":
        return cpu_offload(resident_model())
    return resident_model()


def assert_bytes_equal(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.view(-1).view(torch.uint8), expected.contiguous().view(-1).view(torch.uint8))


def assert_is_the_model(tensors):
    """Every tensor of the resident model's state dict, the tied lm_head.weight once (as wte)."""
    expected = resident_model().state_dict()
    assert set(tensors) == set(expected) - {"lm_head.weight"}
    for name, t in tensors.items():
        assert_bytes_equal(t, expected[name])


def shard_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["offload_dir", "offload_dir+resident", "checkpoint", "cpu", "plain"])
def test_a_single_file_holds_every_tensor_once(tmp_path, how):
    model = offloaded(how, tmp_path)
    out = save_checkpoint(model, tmp_path / "w.safetensors")
    assert out == str(tmp_path / "w.safetensors")
    assert_is_the_model(load_file(out))
    with safetensors.safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert_same_outputs(model)  # still offloaded and working
    reloaded = disk_offload(meta_model(), checkpoint=out)
    assert_same_outputs(reloaded)
    remove_offload(reloaded)


def test_offloaded_weights_are_read_through_the_fetcher(tmp_path):
    model = offloaded("offload_dir", tmp_path)  # a 64 KiB ring: most records do not fit, the read-ahead stops
    before = stats(model)["bytes_read"]
    save_checkpoint(model, tmp_path / "w.safetensors")
    assert stats(model)["bytes_read"] > before
    assert all(f.users == 0 for f in _offloaded[model].fetcher.fetches.values())  # nothing left held


@pytest.mark.parametrize("how", ["offload_dir", "cpu"])
def test_sharded_export_loads_in_transformers_and_disk_offload(tmp_path, how):
    model = offloaded(how, tmp_path)
    out = save_checkpoint(model, tmp_path / "export", max_shard_size="100KB")
    directory = tmp_path / "export"
    assert out == str(directory / "model.safetensors.index.json")
    shards = shard_files(directory)
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in shards:
        assert os.path.getsize(directory / shard) <= 100_000 + 8192 or len(load_file(directory / shard)) == 1
        part = load_file(directory / shard)
        assert all(index["weight_map"][name] == shard for name in part)
        tensors.update(part)
    assert_is_the_model(tensors)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert not [n for n in os.listdir(directory) if n.startswith(".")]  # no temporary files left

    resident_model().config.save_pretrained(directory)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ids, logits, _ = reference()
    with torch.no_grad(), one_thread():
        assert torch.equal(loaded(ids).logits, logits)
    reloaded = disk_offload(meta_model(), checkpoint=directory)
    assert_same_outputs(reloaded)


def test_an_existing_directory_gets_shards_and_stale_files_go(tmp_path):
    directory = tmp_path / "export"
    resident_model().save_pretrained(directory)  # model.safetensors, which loaders would prefer to the index
    model = offloaded("offload_dir", tmp_path)
    save_checkpoint(model, directory, max_shard_size="100KB")
    many = shard_files(directory)
    assert "model.safetensors" not in many and len(many) >= 3
    save_checkpoint(model, directory)  # a directory: shards of up to 50GB, here one
    assert shard_files(directory) == ["model-00001-of-00001.safetensors"]
    assert os.path.exists(directory / "config.json")  # what is not the checkpoint's stays
    assert_is_the_model(load_file(directory / "model-00001-of-00001.safetensors"))


@pytest.mark.parametrize("index", [b"[" * 100000 + b"]" * 100000, b'{"weight_map": 7}', b"\xff\xfe{"],
                         ids=["deeply-nested", "weight-map-an-int", "not-utf8"])
def test_an_export_over_a_directory_with_a_defective_index_replaces_it(tmp_path, index):
    """The index already in the directory only tells which shards the new export must not replace before its own
    index is committed; a deeply nested one made save_checkpoint raise RecursionError from json."""
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    model = torch.nn.Linear(4, 4)
    save_checkpoint(model, tmp_path, max_shard_size="1KB")
    back = {}
    for name in shard_files(tmp_path):
        back.update(load_file(tmp_path / name))
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].keys() == back.keys()


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.b.weight = self.a.weight  # a tie between resident tensors
        self.register_buffer("steps", torch.arange(4))
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, x):
        return self.b(self.a(x)) + self.steps.sum()


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "cpu_offload"])
def test_a_plain_module_saves_its_state_dict_ties_once(tmp_path, offload):
    torch.manual_seed(0)
    model = _Module()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if offload:
        cpu_offload(model, offload_buffers=True)
    got = load_file(save_checkpoint(model, tmp_path / "m.safetensors"))
    assert set(got) == {"a.weight", "a.bias", "b.bias", "steps"}  # b.weight is a.weight; cache is not persistent
    for name, t in got.items():
        assert_bytes_equal(t, expected[name])


def test_bfloat16_and_mixed_dtypes(tmp_path):
    model = resident_model().to(torch.bfloat16)
    model.transformer.wpe.to(torch.float16)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    disk_offload(model, tmp_path / "od")
    got = load_file(save_checkpoint(model, tmp_path / "w.safetensors"))
    for name, t in got.items():
        assert_bytes_equal(t, expected[name])


def _digests(directory):
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in sorted(os.listdir(directory))}


def _fail_after(monkeypatch, calls, exc):
    real, count = export_tensors.Reader._offloaded, [0]

    def failing(self, slot):
        count[0] += 1
        if count[0] > calls:
            raise exc
        return real(self, slot)

    monkeypatch.setattr(export_tensors.Reader, "_offloaded", failing)


@pytest.mark.slow
@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["full-disk", "ctrl-c"])
@pytest.mark.parametrize("sharded", [True, False], ids=["directory", "file"])
def test_a_failure_mid_write_leaves_the_previous_export_and_no_debris(tmp_path, monkeypatch, exc, sharded):
    target = tmp_path / "out" / ("export" if sharded else "w.safetensors")
    os.mkdir(tmp_path / "out")
    kwargs = {"max_shard_size": "100KB"} if sharded else {}
    save_checkpoint(resident_model(), target, **kwargs)
    before = _digests(tmp_path / "out") if not sharded else _digests(target)
    changed = resident_model()
    with torch.no_grad():
        changed.transformer.wte.weight.add_(1)
    wte = changed.transformer.wte.weight.detach().clone()
    disk_offload(changed, tmp_path / "od")
    _fail_after(monkeypatch, 5, exc)
    with pytest.raises(type(exc)):
        save_checkpoint(changed, target, **kwargs)
    assert (_digests(tmp_path / "out") if not sharded else _digests(target)) == before
    # a first export into a directory that does not exist yet leaves nothing at all
    with pytest.raises(type(exc)):
        save_checkpoint(changed, tmp_path / "out" / ("new" if sharded else "new.safetensors"), **kwargs)
    assert sorted(os.listdir(tmp_path / "out")) == [os.path.basename(target)]
    monkeypatch.undo()
    save_checkpoint(changed, target, **kwargs)  # and the next export goes through
    tensors = load_file(target) if not sharded else {k: v for s in shard_files(target) for k, v in
                                                     load_file(target / s).items()}
    assert torch.equal(tensors["transformer.wte.weight"], wte)


def test_a_killed_export_leaves_temporary_files_the_next_export_removes(tmp_path):
    directory = tmp_path / "export"
    save_checkpoint(resident_model(), directory, max_shard_size="100KB")
    dead = directory / ".model-00001-of-00009.safetensors.swapio-ckpt-0123456789abcdef.tmp"
    dead.write_bytes(b"partial")  # what a SIGKILL leaves: a temporary file nobody holds a lock on
    save_checkpoint(resident_model(), directory, max_shard_size="100KB")
    assert not dead.exists()


def test_bad_input(tmp_path):
    model = resident_model()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        save_checkpoint(model.state_dict(), tmp_path / "w.safetensors")
    for bad in (0, -1, True, 1.5, "5XB", "GB", "", "-5GB", [1]):
        with pytest.raises(ValueError, match="max_shard_size"):
            save_checkpoint(model, tmp_path / "d", max_shard_size=bad)
    with pytest.raises(ValueError, match="directory"):
        save_checkpoint(model, tmp_path / "w.safetensors", max_shard_size="1GB")
    for target, kwargs in ((tmp_path / "missing" / "w.safetensors", {}),
                           (tmp_path / "missing" / "d", {"max_shard_size": "1GB"})):
        with pytest.raises(OSError) as info:
            save_checkpoint(model, target, **kwargs)
        assert info.value.errno == errno.ENOENT and str(target) in str(info.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="file"):
        save_checkpoint(model, tmp_path / "file", max_shard_size="1GB")
    disk_offload(model, tmp_path / "od")
    with pytest.raises(ValueError, match="submodules"):
        save_checkpoint(model.transformer, tmp_path / "w.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["file", "od"]  # nothing created by the refused calls


def test_shard_sizes_read_as_transformers_reads_them():
    assert shard_size(1234) == 1234
    assert shard_size("5GB") == 5 * 10**9
    assert shard_size("500MB") == 500 * 10**6
    assert shard_size("100KB") == 100_000
    assert shard_size("2GiB") == 2 << 30
    assert shard_size("8Gb") == 10**9  # gigabits, as in transformers
    assert shard_size("300") == 300


MiB = 1 << 20
WIDTH, LAYERS = 4096, 12  # 12 x 64 MiB fp32 = 768 MiB of weights
RSS_CHILD = PRELUDE + textwrap.dedent("""
    import json, sys
    import torch
    from swapio.offload import disk_offload, save_checkpoint

    source, out, width, layers, buffer_bytes = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    disk_offload(model, checkpoint=source, buffer_bytes=buffer_bytes)
    baseline = status("VmRSS")  # the ring counts from here on
    reset = reset_peak()
    save_checkpoint(model, out)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "reset": reset}))
""")


@pytest.mark.slow
def test_exporting_768_mib_keeps_rss_within_ring_staging_and_one_record(tmp_path):
    """Peak RSS growth stays within the ring + the checkpoint writer's staging + the largest record + slack, less
    than the weights: no state dict is ever built."""
    free = shutil.disk_usage(tmp_path).free
    if free < 2 * LAYERS * 64 * MiB:
        pytest.skip(f"needs {2 * LAYERS * 64} MiB free on {tmp_path}, has {free / MiB:.0f} MiB")
    layer = WIDTH * WIDTH * 4
    header = {f"{i}.weight": {"dtype": "F32", "shape": [WIDTH, WIDTH], "data_offsets": [i * layer, (i + 1) * layer]}
              for i in range(LAYERS)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    source = tmp_path / "source.safetensors"
    with open(source, "wb") as f:  # zeros, as a sparse file: nothing to write, nothing held by the test
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + LAYERS * layer)
    buffer_bytes = 64 * MiB
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", RSS_CHILD, str(source), str(tmp_path / "out.safetensors"), str(WIDTH),
                        str(LAYERS), str(buffer_bytes)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["reset"]:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    growth = out["peak"] - out["baseline"]
    bound = buffer_bytes + layer + DEFAULT_STAGING + 128 * MiB
    print(f"export of {LAYERS * layer / MiB:.0f} MiB: peak RSS grew by {growth / MiB:.0f} MiB "
          f"(bound {bound / MiB:.0f})")
    assert growth <= bound < LAYERS * layer, f"peak RSS grew by {growth / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB"
    with safetensors.safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(header)
        assert not f.get_slice("11.weight")[-1:].any()


def _loaded_value(directory):
    """What a loader finds in directory, following its index: the one value every tensor holds (a whole export),
    else an AssertionError (a missing index or shard, a tensor missing, two exports mixed)."""
    from helpers.export_crash_child import model_of
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / shard))
    assert set(tensors) == set(index["weight_map"]) == set(model_of(0).state_dict())
    values = {v for t in tensors.values() for v in t.unique().tolist()}
    assert len(values) == 1, values
    return values.pop()


@pytest.mark.crash
@pytest.mark.parametrize("sizes", [("40KB", "40KB"), ("40KB", "100KB"), ("100KB", "40KB")],
                         ids=["same-shards", "fewer-shards", "more-shards"])
def test_a_re_export_killed_at_any_step_leaves_the_previous_or_the_new_export(tmp_path, sizes):
    """SIGKILL right before each change an export makes to the directory, in turn: a loader following the index
    finds the previous export or the new one, whole, at every step; what killed exports left goes with the next
    export that finishes."""
    from helpers.export_crash_child import export_until
    from helpers.fork import fork_server, run_child
    ctx = fork_server()
    directory = tmp_path / "export"
    first, then = sizes
    assert run_child(ctx, export_until, str(directory), 1.0, first, 0) == 0
    committed, step, seen = 1.0, 1, set()
    while True:
        value = 1.0 + step
        code = run_child(ctx, export_until, str(directory), value, then, step)
        got = _loaded_value(directory)
        seen.update(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert got in (committed, value), (step, got, committed, value)
        committed = got
        if code == 0:
            break
        assert code == -signal.SIGKILL, code
        step += 1
    assert committed == value and step > 5
    names = sorted(os.listdir(directory))  # the index and the shards it names, nothing else
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert names == sorted({"model.safetensors.index.json", *index["weight_map"].values()})
    assert all(re.fullmatch(r"model-(\d{5})-of-(\d{5})\.safetensors", n) for n in names[:-1]), names
    assert any(".swapio-" in n for n in seen)  # re-exports of the same names: the new shards came in tagged
