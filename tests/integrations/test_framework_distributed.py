"""torch.distributed (gloo, 2 processes on the loopback): DDP with OffloadAdamW, and ZeroRedundancyOptimizer with
optimizer_class=OffloadAdamW in nvme mode (each rank its own swap directory), each against a single-process run
on the same data; the consolidated ZeRO state dict loads into torch.optim.AdamW and into an OffloadAdamW with
another swap_dir. FSDP2 (fully_shard) on the CPU: OffloadAdamW in nvme mode steps each rank's local shards of
the DTensor parameters, against a single-process run and torch's AdamW over FSDP2. The two processes are
spawned once for the module; each test checks what they wrote."""
import faulthandler
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import swapio.optim as so
from helpers.frameworks import assert_params_equal, mlp, mlp_batches, params_of
from helpers.distributed import free_port  # noqa: E402

pytestmark = pytest.mark.slow

WORLD, STEPS = 2, 4
LR, WD = 1e-2, 0.1
NVME = {"buffer_bytes": 3 << 16, "buffer_count": 3}


def _local_steps(model, opt, rank):
    """STEPS steps; each rank sees its half of every batch (DDP averages the gradients)."""
    for x, y in mlp_batches(STEPS):
        half = x.shape[0] // WORLD
        rows = slice(rank * half, (rank + 1) * half)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _worker(rank, port, out_dir):
    faulthandler.enable()  # a native abort in a rank prints where it happened
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        results = {}
        ddp = torch.nn.parallel.DistributedDataParallel(mlp())
        opt = so.OffloadAdamW(ddp.parameters(), lr=LR, weight_decay=WD)
        _local_steps(ddp, opt, rank)
        results["ddp"] = params_of(ddp.module)

        swap_dir = os.path.join(out_dir, f"swap-rank{rank}")
        os.makedirs(swap_dir)
        ddp = torch.nn.parallel.DistributedDataParallel(mlp())
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=so.OffloadAdamW, lr=LR, weight_decay=WD,
                                       offload="nvme", swap_dir=swap_dir, **NVME)
        results["zero_swap_path"] = zero.optim.swap_path
        results["zero_local_params"] = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
        _local_steps(ddp, zero, rank)
        results["zero"] = params_of(ddp.module)
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(zero.state_dict(), os.path.join(out_dir, "zero-consolidated.pt"))
        zero.optim.close()
        results["zero_swap_left"] = os.listdir(swap_dir)

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (WORLD,))
        model = fully_shard(mlp(), mesh=mesh)  # FSDP2: DTensor parameters, each rank holding a shard of dim 0
        fsdp_dir = os.path.join(out_dir, f"fsdp-rank{rank}")
        os.makedirs(fsdp_dir)
        with so.OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, offload="nvme", swap_dir=fsdp_dir,
                             **NVME) as opt:
            _local_steps(model, opt, rank)
            results["fsdp_state_shapes"] = [tuple(st["exp_avg"].shape) for st in opt.state_dict()["state"].values()]
        results["fsdp_local_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
        results["fsdp"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        model = fully_shard(mlp(), mesh=mesh)
        torch_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
        _local_steps(model, torch_opt, rank)
        results["fsdp_torch"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        results["fsdp_torch_state"] = _local_moments(torch_opt.state_dict())
        try:  # torch's state dict of DTensor moments, loaded rank by rank: each takes its shard
            with so.OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD) as opt:
                opt.load_state_dict(torch_opt.state_dict())
                results["fsdp_loaded_state"] = _local_moments(opt.state_dict())
        except ValueError as exc:
            results["fsdp_loaded_state"] = str(exc)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


def _local_moments(state_dict):
    return {i: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items() if k != "step"}
            for i, st in state_dict["state"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    for attempt in (1, 2):
        out_dir = tmp_path_factory.mktemp("distributed")
        try:
            mp.spawn(_worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
            break
        except mp.ProcessExitedException as exc:
            # Seen once in ~60 CI-like runs: a rank killed by SIGABRT ("terminate called without an active
            # exception", gloo's teardown) after its work. A second such death in a row fails the test; the
            # first is reported, with the rank's traceback (faulthandler) above, not hidden.
            if attempt == 2 or exc.signal_name is None:
                raise
            warnings.warn(f"distributed ranks died once ({exc}); ran them again", RuntimeWarning)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return out_dir, ranks


def _single_process(mode, tmp_path):
    model = mlp()
    extra = {"swap_dir": tmp_path, **NVME} if mode == "nvme" else {}
    with so.OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, offload=mode, **extra) as opt:
        for x, y in mlp_batches(STEPS):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return params_of(model)


def _assert_close(a, b):
    for k in b:  # gradients averaged over ranks vs over the whole batch: float32 summation order differs
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_ddp_matches_single_process(runs, tmp_path):
    _, ranks = runs
    assert_params_equal(ranks[0]["ddp"], ranks[1]["ddp"])
    _assert_close(ranks[0]["ddp"], _single_process("cpu", tmp_path))


def test_zero_with_nvme_offload_matches_single_process(runs, tmp_path):
    out_dir, ranks = runs
    assert_params_equal(ranks[0]["zero"], ranks[1]["zero"])
    _assert_close(ranks[0]["zero"], _single_process("nvme", tmp_path))
    total = sum(p.numel() for p in mlp().parameters())
    assert sum(r["zero_local_params"] for r in ranks) == total  # each rank stepped its own shard
    for rank, r in enumerate(ranks):
        assert os.path.dirname(r["zero_swap_path"]) == str(out_dir / f"swap-rank{rank}")
        assert r["zero_swap_left"] == []


def _continue(opt, model, batches):
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def test_consolidated_zero_state_dict_loads_into_torch_and_offload_adamw(runs, tmp_path):
    out_dir, ranks = runs
    def load():  # a fresh copy each time: torch's AdamW increments the loaded "step" tensors in place
        return torch.load(out_dir / "zero-consolidated.pt", weights_only=True)

    sd = load()
    assert {"offload", "swap_dir", "buffer_bytes"} <= set(sd["param_groups"][0])
    more = mlp_batches(2, seed=7)

    torch_model = mlp()
    torch_model.load_state_dict(ranks[0]["zero"])
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    torch_opt.load_state_dict(load())
    assert [torch_opt.state[p]["step"].item() for p in torch_model.parameters()] == [STEPS] * 4
    expected = _continue(torch_opt, torch_model, more)

    model = mlp()
    model.load_state_dict(ranks[0]["zero"])
    other_dir = tmp_path / "elsewhere"
    other_dir.mkdir()
    with so.OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, offload="nvme", swap_dir=other_dir,
                         **NVME) as opt:
        opt.load_state_dict(sd)
        assert os.path.dirname(opt.swap_path) == str(other_dir)  # the saved swap_dir key does not move it
        loaded = opt.state_dict()["state"]
        for i, p in enumerate(model.parameters()):
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded[i][name], sd["state"][i][name])
        got = _continue(opt, model, more)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)
    for rank in range(WORLD):
        assert os.listdir(out_dir / f"swap-rank{rank}") == []


def test_fsdp2_local_shards_step_like_a_single_process_and_like_torch_adamw(runs, tmp_path):
    _, ranks = runs
    for r in ranks:  # the state of each parameter is its rank's shard of it
        assert r["fsdp_state_shapes"] == r["fsdp_local_shapes"]
    assert sum(shape[0] for r in ranks for shape in r["fsdp_local_shapes"][:1]) == 24  # dim 0 split in two
    assert_params_equal(ranks[0]["fsdp"], ranks[1]["fsdp"])
    _assert_close(ranks[0]["fsdp"], _single_process("cpu", tmp_path))
    _assert_close(ranks[0]["fsdp"], ranks[0]["fsdp_torch"])


def test_torch_adamw_state_dict_of_fsdp2_shards_loads_rank_by_rank(runs):
    """torch's AdamW over FSDP2 keeps DTensor moments; each rank's OffloadAdamW loads its local shard of them (it
    refused them, counting the DTensor's global elements against the shard's)."""
    _, ranks = runs
    for r in ranks:
        assert isinstance(r["fsdp_loaded_state"], dict), r["fsdp_loaded_state"]
        assert r["fsdp_loaded_state"].keys() == r["fsdp_torch_state"].keys()
        for i, moments in r["fsdp_torch_state"].items():
            for name, t in moments.items():
                assert torch.equal(r["fsdp_loaded_state"][i][name], t), (i, name)
