"""Files that use what format version 2 added (nn.Parameter and requires_grad, torch.Size, Counter, a
state_dict()'s module versions, a container reached twice) say version 2, which an earlier swapio (reading up to 1)
refuses with a clear message: it read the Parameter, Counter and module-version marks and dropped them silently
(a Parameter loaded as a plain tensor), and the others as a malformed structure. A file that uses none of them stays
version 1, readable by an earlier swapio as before."""
import collections
import json

import pytest
import torch

import swapio.checkpoint as ckpt
from swapio.checkpoint import format as checkpoint_format


def header_metadata(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n])["__metadata__"]


shared = {"lr": 0.1}
NEW_FEATURES = {
    "a Parameter": {"w": torch.nn.Parameter(torch.ones(2))},
    "requires_grad": {"w": torch.ones(2, requires_grad=True)},
    "a torch.Size": {"shape": torch.Size([2, 3])},
    "a Counter": {"milestones": collections.Counter({3: 1})},
    "module versions": torch.nn.Linear(2, 2).state_dict(),
    "a container reached twice": {"a": shared, "b": shared},
}


@pytest.mark.parametrize("what", list(NEW_FEATURES))
def test_a_file_using_what_version_2_added_says_so_and_an_earlier_reader_refuses_it(tmp_path, what, monkeypatch):
    path = tmp_path / "c.safetensors"
    ckpt.save(NEW_FEATURES[what], path)
    assert header_metadata(path)["format_version"] == "2"
    monkeypatch.setattr(checkpoint_format, "VERSION", "1")  # what an earlier swapio reads
    with pytest.raises(ValueError, match="checkpoint format version 2; this swapio reads up to 1"):
        ckpt.load(path)


def test_a_file_of_plain_values_stays_version_1_and_loads_in_an_earlier_reader(tmp_path, monkeypatch):
    state = {"w": torch.arange(6.0).view(2, 3).t(), "step": 3, "names": ["a", "b"], "pair": (1, 2.5),
             "nested": {"x": None, "y": torch.zeros(0)}}
    path = tmp_path / "c.safetensors"
    ckpt.save(state, path)
    assert header_metadata(path)["format_version"] == "1"
    monkeypatch.setattr(checkpoint_format, "VERSION", "1")
    back = ckpt.load(path)
    assert torch.equal(back["w"], state["w"]) and back["names"] == ["a", "b"] and back["pair"] == (1, 2.5)
    assert back["nested"]["x"] is None and back["step"] == 3


def test_a_later_version_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    ckpt.save({"shape": torch.Size([1])}, path)
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"format_version":"2"')
    raw[at:at + 20] = b'"format_version":"3"'
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="format version 3; this swapio reads up to 2"):
        ckpt.load(path)
