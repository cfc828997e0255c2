"""`swapio plan` with fp32 weights: a contiguous fp32 CPU parameter is its own master, but one on a GPU or
offloaded (swapio.offload) is not, and the optimizer keeps an fp32 copy of it. The plan counted no master for
fp32 in every layout, so the rows with a GPU and with the weights offloaded undercounted the state by 4 bytes a
parameter (8 instead of Adam's 12). Measured here on offloaded weights (the same rule, needs_master, as a GPU's)."""
import pytest
import torch

import swapio
from swapio.offload import cpu_offload
from swapio.tools import memplan

ROW = 'weights offloaded, "cpu" (all in RAM)'
CPU_ROW = 'no GPU, offload="cpu" (all in RAM)'


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32)).to(dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer, cls, state_dtype", [("adamw", swapio.optim.OffloadAdamW, "fp32"),
                                                         ("adamw", swapio.optim.OffloadAdamW, "int8"),
                                                         ("lion", swapio.optim.OffloadLion, "bf16"),
                                                         ("adafactor", swapio.optim.OffloadAdafactor, "fp32")])
def test_offloaded_weights_keep_an_fp32_master_whatever_their_dtype(dtype, optimizer, cls, state_dtype):
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    model = _model(torch_dtype)
    shapes = [tuple(p.shape) for p in model.parameters()]
    planned = memplan.plan(shapes=shapes, dtype=dtype, optimizer=optimizer, state_dtype=state_dtype)
    model = cpu_offload(model)
    with cls(model.parameters(), state_dtype=state_dtype) as opt:
        model(torch.randn(4, 64, dtype=torch_dtype)).float().sum().backward()
        opt.step()
        measured = opt.memory_report()["state_bytes"]
    assert planned["totals"]["optimizer_state_gpu"] == measured
    rows = {row["name"]: row for row in planned["layouts"]}
    totals = planned["totals"]
    assert rows[ROW]["ram"] == totals["weights"] + 4 * planned["params"] + measured  # + the fp32 gradient sums
    assert rows['offload="cpu" (state in RAM)']["ram"] == measured  # a GPU's parameters: the same master


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpu_parameters_are_their_own_master_only_in_fp32(dtype):
    """Without a GPU, resident fp32 parameters keep no master: the no-GPU rows count none."""
    model = _model(torch.float32 if dtype == "fp32" else torch.bfloat16)
    params = list(model.parameters())
    planned = memplan.plan(shapes=[tuple(p.shape) for p in params], dtype=dtype)
    with swapio.optim.OffloadAdamW(params) as opt:
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        measured = opt.memory_report()["state_bytes"]
    assert planned["totals"]["optimizer_state"] == measured
    rows = {row["name"]: row for row in planned["layouts"]}
    assert rows[CPU_ROW]["ram"] == planned["totals"]["weights"] + planned["totals"]["grads"] + measured
    extra = planned["totals"]["optimizer_state_gpu"] - planned["totals"]["optimizer_state"]
    assert extra == (4 * planned["params"] if dtype == "fp32" else 0)
