"""A model offloaded from a checkpoint reads its weights from the file at every forward. Another program writing
over that file in place (same inode: cp, open(path, "wb"), a patch of its bytes) made the forwards compute with
the new bytes at the old header's offsets, or a mix of old and new, silently. Each fetch now checks, once its read
finished and before its bytes are used, that the file is as its header was parsed (files.check_unchanged): a
ValueError naming the file at that forward and at every later one, and nothing brought back or saved from it.
(A file replaced at its name by a rename is refused by the reads: test_offload_checkpoint_replaced.py.)"""
import errno
import json
import os
import shutil

import pytest
import safetensors.torch
import torch

import swapio
from swapio.offload import disk_offload, remove_offload, save_checkpoint
from swapio.optim import OffloadAdamW
from swapio.safetensors import open_checkpoint

REWRITTEN = "written in place while a model was offloaded from it"
OLD_NS = 1_000_000_000 * 10**9  # an mtime long past: any later write gives the file another one


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 128))


def meta():
    with torch.device("meta"):
        return build()


def state(model, scale=1.0):
    return {k: (v * scale).contiguous() for k, v in model.state_dict().items()}


def write_checkpoint(path, tensors):
    """A safetensors file written long ago (its mtime set back, so that a rewrite within the same clock tick
    cannot keep it)."""
    with open(path, "wb") as f:
        f.write(safetensors.torch.save(tensors))
    os.utime(path, ns=(OLD_NS, OLD_NS))
    return str(path)


def same_size_other_values(path, reference, tmp_path):
    """Other weights, same names and shapes: the same header, so the same size and offsets."""
    with open(path, "wb") as f:  # as cp, or safetensors' save_file where it truncates the file
        f.write(safetensors.torch.save(state(reference, 3.0)))


def copied_over(path, reference, tmp_path):
    other = write_checkpoint(tmp_path / "other.safetensors", state(reference, -1.0))
    shutil.copyfile(other, path)  # cp: truncates and writes the same inode


def patched(path, reference, tmp_path):
    """A few bytes of the data changed in place, the size kept."""
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(b"\x7f" * 4096)


def bigger(path, reference, tmp_path):
    with open(path, "wb") as f:
        f.write(safetensors.torch.save({**state(reference, 2.0), "extra": torch.ones(1000)}))


def smaller(path, reference, tmp_path):
    """Shorter than the reads at the old offsets: they would run past its end."""
    with open(path, "wb") as f:
        f.write(safetensors.torch.save({"0.bias": state(reference)["0.bias"]}))


REWRITES = [same_size_other_values, copied_over, patched, bigger, smaller]


def offloaded(path, **kw):
    kw.setdefault("prefetch", 0)
    kw.setdefault("buffer_bytes", 1 << 20)
    return disk_offload(meta(), checkpoint=path, **kw)


@pytest.mark.parametrize("rewrite", REWRITES, ids=lambda f: f.__name__)
def test_a_checkpoint_rewritten_in_place_between_forwards_fails_every_later_forward(tmp_path, rewrite):
    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    x = torch.randn(3, 256)
    model = offloaded(path)
    ino = os.stat(path).st_ino
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        rewrite(path, reference, tmp_path)
        assert os.stat(path).st_ino == ino  # in place, not replaced
        for _ in range(3):  # never a result from the rewritten file, at any later forward
            with pytest.raises(ValueError, match=REWRITTEN) as info:
                model(x)
            assert isinstance(info.value, OSError) and info.value.errno == errno.ESTALE
            assert info.value.filename == path and "offload it from the file as it is now" in str(info.value)
    with pytest.raises(ValueError, match=REWRITTEN):  # nor are its weights brought back, or saved
        save_checkpoint(model, tmp_path / "saved")
    with pytest.raises(ValueError, match=REWRITTEN):
        remove_offload(model)
    assert not os.path.exists(tmp_path / "saved" / "model.safetensors")


def test_a_rewrite_between_a_read_ahead_and_its_use_is_caught(tmp_path):
    """The next layer's record is read ahead while the first computes; the file changes in between: its bytes,
    whichever they are, are refused at its use."""
    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    model = offloaded(path, prefetch=1, buffer_bytes=8 << 20)
    issued = []

    def rewrite_after_first_layer(module, args, output):
        issued.append(swapio.offload.stats(model)["reads"])
        same_size_other_values(path, reference, tmp_path)

    model[0].register_forward_hook(rewrite_after_first_layer)
    with torch.no_grad(), pytest.raises(ValueError, match=REWRITTEN):
        model(torch.randn(3, 256))
    assert issued[0] >= 2  # one read a record here: the next layer's was issued before the rewrite


def test_without_a_rewrite_the_outputs_are_the_resident_models(tmp_path):
    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    model = offloaded(path, prefetch=1)
    with open(path, "rb") as f:  # reading the file (its atime) is no change
        f.read()
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(model(x), reference(x))
    remove_offload(model)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value)


def test_one_rewritten_shard_of_a_sharded_checkpoint_is_named(tmp_path):
    reference = build()
    tensors = state(reference)
    shards = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias", "1.weight"],
              "model-00002-of-00002.safetensors": ["1.bias", "2.weight", "2.bias"]}
    for shard, names in shards.items():
        write_checkpoint(tmp_path / shard, {n: tensors[n] for n in names})
    weight_map = {n: shard for shard, names in shards.items() for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    x = torch.randn(3, 256)
    model = offloaded(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        second = str(tmp_path / "model-00002-of-00002.safetensors")
        with open(second, "wb") as f:
            f.write(safetensors.torch.save({n: tensors[n] * 2 for n in shards["model-00002-of-00002.safetensors"]}))
        with pytest.raises(ValueError, match=REWRITTEN) as info:
            model(x)
    assert info.value.filename == second


def test_weights_kept_resident_are_not_read_from_a_file_rewritten_since_its_header(tmp_path):
    """keep_resident weights are read once, by disk_offload: from a header parsed before the file changed."""
    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    opened = open_checkpoint(path)  # the header parsed now (as from_pretrained does), the file rewritten after
    same_size_other_values(path, reference, tmp_path)
    with pytest.raises(ValueError, match="written while it was being loaded"):
        disk_offload(meta(), checkpoint=opened, keep_resident=["2"])


def test_training_copies_nothing_from_a_rewritten_checkpoint_into_offload_dir(tmp_path):
    """The first optimizer moves the records it trains from the checkpoint into offload_dir: not from a file
    rewritten since, where the copies would keep the mixed bytes for good."""
    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    model = offloaded(path, offload_dir=tmp_path / "od")
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 256)), reference(torch.ones(1, 256)))
    same_size_other_values(path, reference, tmp_path)
    with pytest.raises(ValueError, match=REWRITTEN):
        OffloadAdamW(model.parameters(), lr=1e-3)
    assert not os.path.exists(tmp_path / "od" / "index.json")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rewrite", [same_size_other_values, smaller], ids=lambda f: f.__name__)
def test_on_cuda_a_rewrite_between_forwards_fails_every_later_forward(tmp_path, rewrite):
    """For CUDA a record is copied to the device as soon as its read is seen finished (Fetcher.pump): the check
    comes before that copy. The ring (1 MiB) holds at most one of the first two records read ahead before the
    rewrite, so the first forward after it reads one after it."""
    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    model = offloaded(path, prefetch=1, execution_device="cuda")
    x = torch.randn(3, 256)
    with torch.no_grad():
        want = build().cuda()(x.cuda())
        for _ in range(2):
            assert torch.equal(model(x.cuda()), want)
        rewrite(path, reference, tmp_path)
        for _ in range(2):
            with pytest.raises(ValueError, match=REWRITTEN):
                model(x.cuda())


def test_a_peft_merge_reads_nothing_from_a_rewritten_checkpoint(tmp_path):
    """peft's merge brings the base weights in (read from the checkpoint) to add the adapter's delta and writes
    them to offload_dir: not from a file rewritten since."""
    peft = pytest.importorskip("peft")
    from helpers import hf_tiny

    hf_tiny.save("llama", tmp_path / "ck")
    path = str(tmp_path / "ck" / "model.safetensors")
    os.utime(path, ns=(OLD_NS, OLD_NS))
    model = swapio.offload.from_pretrained(hf_tiny.arch("llama")[1], tmp_path / "ck", offload_dir=tmp_path / "od",
                                           buffer_bytes=16 << 10)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    hf_tiny.run(model)
    patched(path, None, tmp_path)
    with pytest.raises(ValueError, match=REWRITTEN):
        model.merge_and_unload()


def test_the_gpu_copy_of_a_read_ahead_is_never_made_from_a_rewritten_file(tmp_path, monkeypatch):
    """For CUDA, pump() copies a record to the device as soon as its read finished, ahead of its use: on CPU too
    (its copy recorded instead of made), it makes none from a file rewritten since, and the forward says why."""
    from swapio.offload.registry import offloaded as registry

    reference = build()
    path = write_checkpoint(tmp_path / "model.safetensors", state(reference))
    model = offloaded(path)
    fetcher = registry.get(model).fetcher
    record = registry.get(model).records[1]
    fetch = fetcher.start(record)
    for read in fetch.reads:
        read.wait()
    same_size_other_values(path, reference, tmp_path)
    copies = []
    monkeypatch.setattr(fetcher, "cuda", True)
    monkeypatch.setattr(fetcher, "_copy_to_device", copies.append)
    fetcher.pump()
    assert copies == [] and record not in fetcher.fetches  # dropped, its ring region free
    monkeypatch.undo()
    with torch.no_grad(), pytest.raises(ValueError, match=REWRITTEN):
        model(torch.randn(3, 256))
