"""How activation offload to="nvme" moves CPU tensors: straight from their memory to the disk and back into
recycled blocks (no bounce copy, no fresh pages each step), the last tensors of a forward kept in RAM while the
staging room allows; and that none of it changes what backward computes."""
import os

import pytest
import torch

from helpers.activations import GatedWrites, assert_same_grads, batch, grads_of, make_stack, settle, swap_files
from swapio import _C
from swapio.offload import offload_activations


def direct_io(directory):
    probe = os.path.join(directory, "probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        return _C.probe_file(probe)["direct"]
    finally:
        os.unlink(probe)


def wide_batch():
    return batch(b=2, t=256)  # storages of 64 KiB - 2 MiB: whole pages between the partial ones at the ends


@pytest.mark.slow
def test_cpu_tensors_go_to_disk_and_back_without_bounce_copies(tmp_path):
    if not direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: every transfer goes through the page cache anyway")
    model, x = make_stack(), wide_batch()
    want = grads_of(model, x)
    before = _C.held_bytes()["bounce"]
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=0)
    for _ in range(2):
        assert_same_grads(grads_of(model, x, act), want)
    stats = act.stats()
    assert stats["read_bytes"] > 0 and stats["bytes"] > 0
    # a handle's workers map their bounce buffers on the first transfer that needs one, and keep them until closed
    assert _C.held_bytes()["bounce"] == before
    act.close()


@pytest.mark.slow
def test_read_buffers_are_reused_step_after_step(tmp_path, monkeypatch):
    from swapio.offload import activation_blocks
    made = []
    real = _C.PinnedBuffer

    class Counting:
        @staticmethod
        def PinnedBuffer(nbytes, lock=True):
            made.append(nbytes)
            return real(nbytes, lock)
    monkeypatch.setattr(activation_blocks, "_C", Counting)
    model, x = make_stack(), wide_batch()
    want = grads_of(model, x)
    # no read-ahead: how far it runs ahead of backward depends on the machine's load, and with it how many blocks
    # are in use at once, so a loaded machine could reach a new peak (a new block) in a later step
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=0, prefetch=0)
    for _ in range(2):
        assert_same_grads(grads_of(model, x, act), want)
    first, read = len(made), act.stats()["read_bytes"]
    assert first > 0 and read > 0
    for _ in range(2):
        assert_same_grads(grads_of(model, x, act), want)
    assert act.stats()["read_bytes"] > read  # read back from the disk again ...
    assert len(made) == first  # ... into the blocks of the steps before
    held = act.stats()["read_buffer_bytes"]
    assert 0 < held <= sum(made)
    act.close()
    assert act.stats()["read_buffer_bytes"] == 0


class Keep(torch.autograd.Function):
    """Hands the tensor its backward got back out of the graph (as a hook or a debugging user might)."""
    kept = []

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * 3

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        Keep.kept.append(a)
        return g * 3


def test_a_tensor_read_back_and_kept_past_its_backward_keeps_its_values(tmp_path):
    """Its block is reused only once nothing uses it: the next steps' reads go elsewhere."""
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    Keep.kept.clear()
    values = []
    for step in range(3):
        a = torch.randn(64, 1024, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with act:
            loss = Keep.apply(a * 1).exp().sum()  # exp's saved output pushes Keep's out of RAM
        loss.backward()
        values.append((a * 1).detach())
    assert act.stats()["read_bytes"] > 0
    for kept, value in zip(Keep.kept, values):
        assert torch.equal(kept, value)
    Keep.kept.clear()
    act.close()


@pytest.mark.slow
def test_with_room_for_everything_the_backward_reads_nothing_back(tmp_path):
    """The last tensors a forward saves stay in RAM while the staging room allows (written all the same): here
    all of them, so the backward finds each in memory."""
    model, x = make_stack(), wide_batch()
    want = grads_of(model, x)
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=256 << 20)
    for _ in range(2):
        assert_same_grads(grads_of(model, x, act), want)
    stats = act.stats()
    assert stats["bytes"] > 0 and stats["read_bytes"] == 0 and stats["unpack_misses"] == 0
    assert swap_files(act.directory) == [] and stats["live_sessions"] == 0
    act.close()


@pytest.mark.parametrize("staging_mib", [0, 1])
def test_with_little_room_the_oldest_are_read_back_and_grads_stay_equal(tmp_path, staging_mib):
    model, x = make_stack(), wide_batch()
    want = grads_of(model, x)
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0,
                              staging_bytes=staging_mib << 20, prefetch=3)
    for _ in range(2):
        assert_same_grads(grads_of(model, x, act), want)
    stats = act.stats()
    assert 0 < stats["read_bytes"] < stats["bytes"]
    assert swap_files(act.directory) == []
    act.close()


def sin_exp(act, a):
    """(2 sin(a)).exp() in act, and b = a * 1, which the sin saves."""
    with act:
        b = a * 1
        c = b.sin()  # saves b
        d = (c * 2).exp()  # saves its output: with no staging room, b's copy in RAM goes
    return b, d


def sin_exp_grad(a):
    return (2 * a.detach().sin()).exp() * 2 * a.detach().cos()


@pytest.mark.parametrize("staging_bytes", [0, 64 << 20], ids=["on-disk", "kept-in-ram"])
def test_a_tensor_changed_in_place_after_its_save_comes_back_as_saved(tmp_path, staging_bytes):
    """Without offload autograd refuses such a backward; with it, a change after the tensor's write was seen
    finished leaves what it saved as it was, whether the backward finds it in RAM or reads it from the disk."""
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=staging_bytes)
    a = torch.randn(256, 1024, requires_grad=True)
    b, d = sin_exp(act, a)
    settle(act)  # b's write finished, and its forward saw it: the disk has b as saved
    b.add_(1)
    d.sum().backward()
    assert torch.equal(a.grad, sin_exp_grad(a))
    act.close()


def test_a_tensor_changed_in_place_while_its_write_is_in_flight_fails_loudly(tmp_path, monkeypatch):
    """A change while the tensor's own memory is being written may tear what it saved: the backward raises
    autograd's error for a saved tensor changed in place, never computes with half-changed bytes, and the
    offload goes on working. (With staging room: without it the forward waits for each write to finish.)"""
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=64 << 20)
    writes = GatedWrites(act, monkeypatch)
    a = torch.randn(256, 1024, requires_grad=True)
    b, d = sin_exp(act, a)
    b.add_(1)  # b's write has not finished
    writes.release()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*\[256, 1024\].*changed in place"):
        d.sum().backward()
    assert a.grad is None
    del b, d
    b, d = sin_exp(act, a)  # the next forward and backward are as without offload
    d.sum().backward()
    assert torch.equal(a.grad, sin_exp_grad(a))
    del b, d
    act.close()
    assert swap_files(tmp_path) == []


def test_read_ahead_past_tensors_kept_in_ram_does_not_walk_the_whole_forward(tmp_path, monkeypatch):
    """Each unpack looked for the next tensors to read back by walking down past every one still in RAM: with all
    of them in RAM, to the first one each time, quadratic in the number of saved tensors (seconds a step with
    thousands). Counted here as the entries looked at, against the tensors a backward unpacks."""
    from swapio.offload import activation_store
    looked = []

    class Counted(list):
        def __getitem__(self, i):
            looked.append(i)
            return super().__getitem__(i)
    real = activation_store.Session.__init__

    def init(self, *args):
        real(self, *args)
        self.entries = Counted()
    monkeypatch.setattr(activation_store.Session, "__init__", init)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(300)])
    x = torch.randn(4, 16)
    want = torch.autograd.grad(layers(x).sum(), list(layers.parameters()))
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=layers, min_bytes=0, staging_bytes=64 << 20)
    with act:
        loss = layers(x).sum()
    got = torch.autograd.grad(loss, list(layers.parameters()))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    unpacks = 2 * len(layers)  # each layer's linear and tanh (one storage)
    assert act.stats()["tensors"] == len(layers) + 1 and act.stats()["read_bytes"] == 0
    assert len(looked) <= 2 * unpacks, f"{len(looked)} entries looked at for {unpacks} unpacks"
    act.close()


def tanh_chain(layers=6, width=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(layers)])


@pytest.mark.parametrize("backward_twice", [False, True], ids=["one-backward", "retain-graph"])
def test_a_storage_two_nodes_saved_is_read_back_once_per_backward(tmp_path, backward_twice):
    """A tanh's output is saved by the tanh (its output) and by the next linear (its input): one storage, one
    entry. Its first unpack brought it back and held it only weakly, so it was gone when the second node needed
    it, and read again (a miss the backward waited for): about twice the bytes read, and most unpacks missed."""
    model, x = tanh_chain(), torch.randn(256, 256)
    want = grads_of(model, x, backward_twice=backward_twice)
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=1 << 16, staging_bytes=0,
                              prefetch=2)
    assert_same_grads(grads_of(model, x, act, backward_twice=backward_twice), want)
    stats = act.stats()
    backwards = 2 if backward_twice else 1
    assert stats["shared_views"] > 0
    assert 0 < stats["read_bytes"] <= backwards * stats["bytes"]  # each storage at most once per backward
    assert stats["unpack_misses"] <= backwards  # the first unpack of each backward, at most
    assert swap_files(act.directory) == []
    act.close()
