"""DistributedDataParallel wrapped around an offloaded model (the other way round from test_offload_wrapped_models).

DDP's default constructor fails inside torch (its broadcast writes into the placeholders). Built with
init_sync=False it constructed, and two ranks then trained their offloaded weights apart without a word: DDP's
hooks are on the parameters, which an offloaded module does not compute with, so no gradient was all-reduced.
Such a forward is now a ValueError on every rank before anything trains. A forward without gradients still runs,
equal to the same forward on resident weights. (DDP itself refuses a model with both resident parameters and
placeholders, whose devices differ, and one whose parameters are all frozen.)"""
import os

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import group_of_one, init_group, run_group
from helpers.offload_training import MLP, OUT, batches, build_opt, loss_of, make_model, offload, weights
from swapio.offload import remove_offload

WORLD = 2
REFUSED = "DistributedDataParallel over offloaded weights is not supported"


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model, init_sync=False)


def _refused_worker(rank, port, arg):
    tmp, storage = arg
    init_group(rank, port, WORLD)
    try:
        model = offload(make_model(MLP), storage, os.path.join(tmp, f"rank{rank}"))
        opt = build_opt("AdamW", model.parameters(), tmp)
        ddp = _ddp(model)
        with pytest.raises(ValueError, match=REFUSED):
            loss_of(ddp, batches(MLP, 1, seed=rank + 1)[0]).backward()
        opt.step()  # nothing arrived: nothing changes
        opt.close()
        remove_offload(model)
        want = weights(make_model(MLP))
        assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_training_forward_of_offloaded_weights_under_ddp_is_refused_on_every_rank(tmp_path, storage):
    assert run_group(_refused_worker, (str(tmp_path), storage), WORLD) == [0, 0]


def test_forward_without_gradients_under_ddp_runs_as_on_resident_weights(tmp_path):
    x = batches(MLP, 1)[0][0]
    with torch.no_grad():
        want = make_model(MLP)(x)
    model = offload(make_model(MLP), "disk", tmp_path)
    with group_of_one(tmp_path / "pg"):
        ddp = _ddp(model)
        with torch.no_grad():
            assert torch.equal(ddp(x), want)
        with pytest.raises(ValueError, match=REFUSED):
            ddp(x)
    assert torch.equal(model(x).detach(), want)  # without DDP the same model trains as before


def test_a_ddp_forward_that_calls_an_offloaded_model_it_does_not_hold_runs(tmp_path):
    teacher = offload(make_model(MLP), "disk", tmp_path)  # e.g. distillation: a frozen-by-use teacher, not a submodule
    student = make_model(MLP, seed=1)

    class Student(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = student

        def forward(self, x):
            return self.net(x) - teacher(x).detach()

    x = batches(MLP, 1)[0][0]
    with group_of_one(tmp_path / "pg"):
        out = _ddp(Student())(x)
    assert torch.equal(out, student(x) - make_model(MLP)(x))


def test_a_data_parallel_replica_of_an_offloaded_model_is_refused(tmp_path):
    model = offload(make_model(MLP), "disk", tmp_path)
    replica = model._replicate_for_data_parallel()  # what DataParallel's replicate() makes of each module
    with pytest.raises(ValueError, match="DataParallel over offloaded weights is not supported"):
        replica(batches(MLP, 1)[0][0])
