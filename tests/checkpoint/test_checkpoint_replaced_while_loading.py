"""A checkpoint replaced at its name while load() reads it (another job's save committing, a `latest` link
repointed): load reads the bytes of the file whose header it parsed, or refuses; it never reads the new file's
bytes at the old header's offsets (which gave each tensor another tensor's values, silently)."""
import errno
import os

import pytest
import torch

import swapio
import swapio.checkpoint.api as checkpoint_api

MiB = 1 << 20
OLD = {"w": torch.full((MiB // 2,), 1.0), "v": torch.full((MiB // 2,), 2.0), "s": torch.full((10,), 5.0)}
# another layout: "w" shorter and "v" longer, so the old header's offsets land in other tensors' bytes
NEW = {"w": torch.full((MiB // 4,), 3.0), "v": torch.full((MiB,), 4.0), "s": torch.full((10,), 6.0)}


def _save_after_header(monkeypatch, path, new=NEW):
    """load() parses the header of the file at `path`, then `new` is saved over it before any byte is read."""
    parse = checkpoint_api.open_checkpoint

    def parse_then_replace(p):
        opened = parse(p)
        swapio.checkpoint.save(new, path)
        return opened
    monkeypatch.setattr(checkpoint_api, "open_checkpoint", parse_then_replace)


@pytest.mark.parametrize("small", [False, True], ids=["direct-reads", "streamed"])
def test_a_file_replaced_after_its_header_was_read_is_refused(tmp_path, monkeypatch, small):
    path = tmp_path / "latest.safetensors"
    old = {"s": OLD["s"]} if small else OLD
    swapio.checkpoint.save(old, path)
    _save_after_header(monkeypatch, path, {"s": NEW["s"], "t": torch.zeros(3)} if small else NEW)
    with pytest.raises(OSError) as info:
        swapio.checkpoint.load(path)
    assert info.value.errno == errno.ESTALE
    assert info.value.filename == str(path)


def test_out_is_left_unchanged_when_the_file_was_replaced(tmp_path, monkeypatch):
    path = tmp_path / "latest.safetensors"
    swapio.checkpoint.save(OLD, path)
    out = {k: torch.zeros_like(v) for k, v in OLD.items()}
    _save_after_header(monkeypatch, path)
    with pytest.raises(OSError):
        swapio.checkpoint.load(path, out=out)
    assert all(torch.count_nonzero(t) == 0 for t in out.values())


def test_a_link_repointed_after_the_header_was_read_loads_the_old_target_whole(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "runs")
    swapio.checkpoint.save(OLD, tmp_path / "runs" / "step-1.safetensors")
    swapio.checkpoint.save(NEW, tmp_path / "runs" / "step-2.safetensors")
    link = tmp_path / "latest"
    os.symlink("runs/step-1.safetensors", link)
    parse = checkpoint_api.open_checkpoint

    def parse_then_repoint(p):
        opened = parse(p)
        os.symlink("runs/step-2.safetensors", tmp_path / "latest.new")
        os.replace(tmp_path / "latest.new", link)
        return opened
    monkeypatch.setattr(checkpoint_api, "open_checkpoint", parse_then_repoint)
    back = swapio.checkpoint.load(link)
    assert set(back) == set(OLD)
    for k, v in OLD.items():
        assert torch.equal(back[k], v), k


def test_a_checkpoint_behind_a_link_loads(tmp_path):
    swapio.checkpoint.save(OLD, tmp_path / "step-1.safetensors")
    os.symlink("step-1.safetensors", tmp_path / "latest")
    back = swapio.checkpoint.load(tmp_path / "latest")
    for k, v in OLD.items():
        assert torch.equal(back[k], v), k


def _rewrite_in_place_after_header(monkeypatch, path, tmp_path):
    """load() parses the header, then another program rewrites the file in place with the other layout (same file,
    truncated and written again, as `cp new latest.safetensors` does)."""
    swapio.checkpoint.save(NEW, tmp_path / "new.safetensors")
    parse = checkpoint_api.open_checkpoint

    def parse_then_rewrite(p):
        opened = parse(p)
        with open(path, "r+b") as f:
            f.truncate(0)
            f.write((tmp_path / "new.safetensors").read_bytes())
        return opened
    monkeypatch.setattr(checkpoint_api, "open_checkpoint", parse_then_rewrite)


def test_a_file_written_in_place_while_loading_is_a_value_error(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    swapio.checkpoint.save(OLD, path)
    ino = os.stat(path).st_ino
    _rewrite_in_place_after_header(monkeypatch, path, tmp_path)
    with pytest.raises(ValueError, match="written while it was being loaded"):
        swapio.checkpoint.load(path)
    assert os.stat(path).st_ino == ino  # (in place indeed: the identity alone cannot tell)
