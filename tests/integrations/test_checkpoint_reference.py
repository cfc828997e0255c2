"""The reference Trainer's optimizer.pt holds instead of the state (swapio.optim.reference): it names the checkpoint
by its absolute path, so a checkpoint directory copied elsewhere still loads the original. If another run has
rewritten that one since, the reference must not load the other run's state (it did, silently): ValueError. A copy
of the same save (opt.save's header holds every array's checksum) loads, and a resume that knows its checkpoint
directory (reference.resuming_from, SwapioTrainer's) looks there first, confined to it."""
import os
import shutil

import pytest
import torch

import swapio
import swapio.optim as so
from swapio.optim import checkpoint as optim_checkpoint, reference

pytest.importorskip("transformers")
from swapio.integrations.transformers import _install, _load_optimizer_file  # noqa: E402


def _trained_offload(seed, tmp_path):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(300))
    opt = so.OffloadAdamW([p], lr=1e-2)
    for _ in range(seed + 1):
        p.grad = torch.randn(300)
        opt.step()
    return opt, p


def test_an_offload_optimizer_reference_loads_its_checkpoint_and_refuses_a_rewritten_one(tmp_path):
    path = tmp_path / "checkpoint-3" / "swapio-optim"
    opt, _ = _trained_offload(1, tmp_path)
    opt.save(path)
    ref = reference.make(str(path), str(path / optim_checkpoint.FILE))
    expected = opt.state_dict()

    fresh, _ = _trained_offload(0, tmp_path)
    fresh.load_state_dict(ref)  # the file it was made for: loads
    got = fresh.state_dict()
    assert torch.equal(got["state"][0]["exp_avg"], expected["state"][0]["exp_avg"])

    other, _ = _trained_offload(2, tmp_path)  # another run writes the same checkpoint directory
    other.save(path)
    victim, _ = _trained_offload(0, tmp_path)
    before = victim.state_dict()
    with pytest.raises(ValueError, match="rewritten since this reference was saved"):
        victim.load_state_dict(ref)
    assert torch.equal(victim.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])

    os.remove(path / optim_checkpoint.FILE)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        victim.load_state_dict(ref)


def test_a_torch_optimizer_reference_refuses_a_rewritten_file(tmp_path):
    file = tmp_path / "checkpoint-3" / "optimizer.safetensors"
    file.parent.mkdir()
    p = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(50)
    opt.step()
    swapio.checkpoint.save(opt.state_dict(), file)
    ref = reference.make(str(file), str(file))

    q = torch.nn.Parameter(p.detach().clone())
    loader = torch.optim.AdamW([q], lr=1e-2)
    _install(loader, _load_optimizer_file)
    loader.load_state_dict(ref)
    assert torch.equal(loader.state[q]["exp_avg"], opt.state[p]["exp_avg"])

    p.grad = torch.randn(50)
    opt.step()
    swapio.checkpoint.save(opt.state_dict(), file)  # rewritten (another run, or the same step saved again)
    with pytest.raises(ValueError, match="rewritten since this reference was saved"):
        loader.load_state_dict(ref)


def test_a_reference_without_identity_from_an_older_version_still_loads(tmp_path):
    path = tmp_path / "swapio-optim"
    opt, _ = _trained_offload(1, tmp_path)
    opt.save(path)
    fresh, _ = _trained_offload(0, tmp_path)
    fresh.load_state_dict({"state": {}, "param_groups": [], reference.REFERENCE_KEY: str(path)})
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_copy_of_the_same_save_loads_and_a_rewritten_one_is_still_refused(tmp_path):
    path = tmp_path / "checkpoint-3" / "swapio-optim"
    opt, _ = _trained_offload(1, tmp_path)
    opt.save(path)
    ref = reference.make(str(path), str(path / optim_checkpoint.FILE), checksummed=True)
    shutil.copytree(path, tmp_path / "copy")
    shutil.rmtree(path)
    shutil.copytree(tmp_path / "copy", path)  # a restored backup: another file, the same bytes
    fresh, _ = _trained_offload(0, tmp_path)
    fresh.load_state_dict(ref)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    other, _ = _trained_offload(2, tmp_path)
    other.save(path)
    with pytest.raises(ValueError, match="rewritten since this reference was saved"):
        fresh.load_state_dict(ref)


def test_resuming_from_a_directory_looks_there_first_and_only_there(tmp_path):
    path = tmp_path / "run" / "checkpoint-3" / "swapio-optim"
    opt, _ = _trained_offload(1, tmp_path)
    opt.save(path)
    ref = reference.make(str(path), str(path / optim_checkpoint.FILE), checksummed=True)
    os.rename(tmp_path / "run", tmp_path / "moved")
    fresh, _ = _trained_offload(0, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fresh.load_state_dict(ref)
    with reference.resuming_from(tmp_path / "moved" / "checkpoint-3"):
        fresh.load_state_dict(ref)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # a crafted reference cannot reach out of the directory resumed (its name's last part only, never "..")
    escape = dict(ref, **{reference.REFERENCE_KEY: str(tmp_path / "nowhere" / "..")})
    with reference.resuming_from(tmp_path / "moved" / "checkpoint-3" / "swapio-optim"):
        assert reference.located(escape) == escape[reference.REFERENCE_KEY]
    with pytest.raises(TypeError, match="by a path"):
        fresh.load_state_dict({"state": {}, "param_groups": [], reference.REFERENCE_KEY: 7})
