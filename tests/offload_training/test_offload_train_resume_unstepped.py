"""Resuming offloaded training from opt.save() when a trainable offloaded weight had no optimizer state yet at the
checkpoint (frozen by a schedule, an expert no batch reached): the checkpoint holds no master for it, so load()
cannot rewrite it. If the offload storage still holds its value of then, the run resumes bit-identically; if it
was trained after the checkpoint, load() refuses (ValueError naming it) instead of resuming with a weight of a
later step, and offloading again from the model saved at the checkpoint (save_checkpoint) resumes exactly."""
import pytest
import torch

import swapio
from swapio.offload import disk_offload, remove_offload, save_checkpoint

pytest.importorskip("safetensors")
LATE = "2.weight"  # in the optimizer from the start, trainable only from step UNFREEZE
UNFREEZE, SAVED_AT, STEPS = 3, 3, 5


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def build_on_meta():
    """The model as a resuming process builds it: no weights of its own, all from the offload storage."""
    with torch.device("meta"):
        return build()


def close(net, opt):
    opt.close()
    remove_offload(net)


def step(net, opt, i):
    net[2].weight.requires_grad_(i >= UNFREEZE)
    gen = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()


def offloaded(net, directory, **kwargs):
    net = disk_offload(net, offload_dir=str(directory), **kwargs)
    return net, swapio.optim.OffloadAdamW(net.parameters(), lr=1e-2, offload="cpu")


def weights(net, path):
    save_checkpoint(net, str(path))
    return swapio.checkpoint.load(str(path))


def run(tmp_path, after_checkpoint):
    """Trains to SAVED_AT, saves the optimizer and the model, trains `after_checkpoint` more steps, and stops."""
    net, opt = offloaded(build(), tmp_path / "od")
    for i in range(SAVED_AT):
        step(net, opt, i)
    opt.save(tmp_path / "opt")
    save_checkpoint(net, str(tmp_path / "model.safetensors"))
    for i in range(SAVED_AT, SAVED_AT + after_checkpoint):
        step(net, opt, i)
    close(net, opt)


def uninterrupted(tmp_path):
    net, opt = offloaded(build(), tmp_path / "od-full")
    for i in range(STEPS):
        step(net, opt, i)
    out = weights(net, tmp_path / "full.safetensors")
    close(net, opt)
    return out


def resume(tmp_path, net, opt):
    opt.load(tmp_path / "opt")
    for i in range(SAVED_AT, STEPS):
        step(net, opt, i)
    return weights(net, tmp_path / "resumed.safetensors")


def assert_same(a, b):
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_weight_trained_after_the_checkpoint_without_state_in_it_is_refused(tmp_path):
    run(tmp_path, after_checkpoint=2)  # LATE trained at steps 3 and 4: the offload_dir holds step 5's value
    net = build_on_meta()
    net, opt = offloaded(net, tmp_path / "od")
    with pytest.raises(ValueError, match=r"parameter 2\b.*no optimizer state.*changed"):
        opt.load(tmp_path / "opt")
    assert not opt.state  # nothing loaded
    close(net, opt)


@pytest.mark.parametrize("after_checkpoint, again", [
    (2, True),   # trained after the checkpoint: offloading again from the model saved with it resumes exactly
    (0, False),  # left as it was: the offload storage still holds the checkpoint's value
])
def test_resuming_with_the_checkpoints_weights_is_exact(tmp_path, after_checkpoint, again):
    want = uninterrupted(tmp_path)
    run(tmp_path, after_checkpoint=after_checkpoint)
    net = build_on_meta()
    kwargs = {"checkpoint": str(tmp_path / "model.safetensors")} if again else {}
    net, opt = offloaded(net, tmp_path / ("od-resumed" if again else "od"), **kwargs)
    assert_same(resume(tmp_path, net, opt), want)
    close(net, opt)


def test_the_same_through_state_dict_and_load_state_dict(tmp_path):
    """accelerate's save_state / load_state and Trainer's optimizer.pt go through torch's state dicts."""
    net, opt = offloaded(build(), tmp_path / "od")
    for i in range(SAVED_AT):
        step(net, opt, i)
    saved = opt.state_dict()
    torch.save(saved, tmp_path / "optimizer.pt")
    opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))  # the weight as it was: loads
    for i in range(SAVED_AT, STEPS):
        step(net, opt, i)
    with pytest.raises(ValueError, match=r"parameter 2\b.*no optimizer state.*changed"):
        opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    assert opt.state[net[2].weight]["step"] == STEPS - UNFREEZE  # nothing loaded
    close(net, opt)


@pytest.mark.parametrize("forged", [["not", "a", "dict"], {2: "xyz"}, {0: "0" * 16}, {99: "0" * 16}])
def test_a_forged_record_is_a_value_error_naming_the_file(tmp_path, forged):
    """The record comes from outside like the rest of the file: a malformed one, one naming a parameter with state
    (0) or none of the checkpoint's (99), is refused before anything changes."""
    import json
    run(tmp_path, after_checkpoint=0)
    path = tmp_path / "opt" / "swapio-optim.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    skeleton = json.loads(header["__metadata__"]["structure"])
    record = next(item for item in skeleton["D"] if item[0] == "unstepped_weights")
    record[1] = {"L": [{"V": v} for v in forged]} if isinstance(forged, list) else \
        {"D": [[k, {"V": v}] for k, v in forged.items()]}
    header["__metadata__"]["structure"] = json.dumps(skeleton)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    net = build_on_meta()
    net, opt = offloaded(net, tmp_path / "od")
    with pytest.raises(ValueError, match="swapio-optim.safetensors"):
        opt.load(tmp_path / "opt")
    assert not opt.state
    close(net, opt)
