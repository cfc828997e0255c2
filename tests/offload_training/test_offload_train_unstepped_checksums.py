"""The checksums an optimizer's checkpoints record of offloaded weights it holds no state of (a frozen base passed
to it with its adapters): each weight is read once, not at every save() and state_dict(), and read again once a
rewrite of its record began, so a checksum is never one of a value the storage no longer holds."""
import pytest
import torch
import xxhash

import swapio
from swapio.offload import cpu_offload, disk_offload, remove_offload, training

FROZEN = "2.weight"


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def offloaded(kind, tmp_path):
    net = build()
    net[2].weight.requires_grad_(False)
    net = cpu_offload(net) if kind == "cpu" else disk_offload(net, offload_dir=str(tmp_path / "od"))
    return net, swapio.optim.OffloadAdamW(net.parameters(), lr=1e-2, offload="cpu")


def step(net, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()


def index_of(opt, p):
    return next(i for i, q in enumerate(opt.param_groups[0]["params"]) if q is p)


def true_checksum(net):
    """xxh3 of the weight's bytes as the model computes with it (an independent read: the onloaded model)."""
    value = net[2].weight.detach().contiguous()
    return xxhash.xxh3_64_intdigest(value.numpy().tobytes())


@pytest.fixture
def reads(monkeypatch):
    """The slots whose value was read from the offload storage (Training.current)."""
    seen = []
    real = training.current_value

    def counting(fetcher, slot):
        seen.append(slot.name)
        return real(fetcher, slot)

    monkeypatch.setattr(training, "current_value", counting)
    return seen


def recorded(opt, p):
    return int(opt.state_dict()["swapio_unstepped_weights"][index_of(opt, p)], 16)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_checkpoints_read_a_weight_without_state_once_until_it_is_rewritten(tmp_path, reads, kind):
    net, opt = offloaded(kind, tmp_path)
    frozen = net[2].weight
    step(net, opt, 1)
    first = recorded(opt, frozen)
    opt.save(tmp_path / "a")
    recorded(opt, frozen)
    opt.save(tmp_path / "b")
    assert reads.count(FROZEN) == 1  # read for the first record only

    for seed in (2, 3):  # steps rewrite the other weights' records, not the frozen one's
        step(net, opt, seed)
    again = recorded(opt, frozen)
    assert reads.count(FROZEN) == 1
    opt.close()
    remove_offload(net)
    assert again == first == true_checksum(net) == true_checksum(build())  # the value it was offloaded with


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_rewrite_of_the_weight_makes_the_next_checkpoint_read_it_again(tmp_path, reads, kind):
    """A rewrite that changed it (as a peft merge's or a load's does) and, to be safe, one of its record given up."""
    net, opt = offloaded(kind, tmp_path)
    frozen = net[2].weight
    train, slot = training.lookup(frozen)
    before = recorded(opt, frozen)

    buf = train.begin(slot.record, need_current=True)
    train.view(buf, slot).mul_(2)
    train.end(slot.record, buf, changed=[slot])
    train.flush()
    reads.clear()
    doubled = recorded(opt, frozen)
    assert reads.count(FROZEN) == 1 and doubled != before

    train.begin(slot.record, need_current=True)
    train.abort(slot.record)
    reads.clear()
    assert recorded(opt, frozen) == doubled and reads.count(FROZEN) == 1
    opt.close()
    remove_offload(net)
    assert doubled == true_checksum(net)
    net[2].weight.data.mul_(0.5)
    assert before == true_checksum(net)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_checkpoint_after_remove_offload_is_refused_not_given_the_cached_checksum(tmp_path, kind):
    """remove_offload makes the weight resident: it may change with no rewrite moving a count, so the checksum
    cached before would be recorded for a value the model no longer holds."""
    net, opt = offloaded(kind, tmp_path)
    frozen = net[2].weight
    step(net, opt, 1)
    recorded(opt, frozen)  # cached
    remove_offload(net)
    with torch.no_grad():
        net[2].weight.mul_(3)
    with pytest.raises(RuntimeError, match="remove_offload"):
        recorded(opt, frozen)
    with pytest.raises(RuntimeError, match="remove_offload"):
        opt.save(tmp_path / "ckpt")
