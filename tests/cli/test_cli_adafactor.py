"""`swapio plan --optimizer adafactor` (bytes per parameter: the master only) and `swapio demo --optimizer
adafactor` (torch.optim.Adafactor beside OffloadAdafactor in both modes), checked against a measured optimizer."""
import json
import os

import pytest
import torch

from swapio.optim import OffloadAdafactor
from swapio.tools import demo, memplan
from helpers.cli import run_cli


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("dtype,master", [("bf16", 4), ("fp32", 0)])
def test_plan_counts_the_master_and_no_moments(capsys, dtype, master):
    rc, out, _ = run_cli(capsys, "plan", "--params", "7B", "--dtype", dtype, "--optimizer", "adafactor", "--json")
    assert rc == 0
    per = json.loads(out)["bytes_per_param"]
    assert (per["master"], per["moments"], per["optimizer_state"]) == (master, 0, master)
    # what the optimizer measures on a weight of an LLM's shape: the master plus under 0.01 bytes
    w = torch.zeros(2048, 2048, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, requires_grad=True)
    w.grad = torch.ones_like(w)
    with OffloadAdafactor([w]) as opt:
        opt.step()
        assert opt.memory_report()["bytes_per_param"] == pytest.approx(per["optimizer_state"], abs=0.01)


def test_plan_refuses_smaller_state_for_adafactor(capsys):
    rc, _, err = run_cli(capsys, "plan", "--params", "7B", "--optimizer", "adafactor", "--state-dtype", "int8")
    assert rc == 2 and "fp32 state only" in err
    with pytest.raises(ValueError, match="fp32 state only"):
        memplan.per_param("bf16", "adafactor", "bf16")


def test_demo_runs_torch_adafactor_beside_offload_adafactor(tmp_path):
    cfg = demo.DemoConfig(steps=4, layers=1, width=32, heads=2, context=16, batch=4, log_every=2, progress=False,
                          buffer_bytes=4 << 16, directory=str(tmp_path), optimizer="adafactor")
    result = demo.run_demo(cfg)
    assert os.listdir(tmp_path) == []
    ref = result.losses["torch Adafactor"]
    assert result.losses['offload="cpu"'] == result.losses['offload="nvme"']
    for loss, expected in zip(result.losses['offload="cpu"'], ref):
        assert loss == pytest.approx(expected, rel=1e-5)
    text = demo.report(result)
    assert "torch Adafactor" in text and "OffloadAdafactor" in text
    with pytest.raises(ValueError, match="--optimizer"):
        demo.DemoConfig(optimizer="sgd").validate()


def test_plan_counts_the_nvme_slots_a_whole_largest_parameter_needs(capsys, tmp_path):
    """nvme mode never splits an Adafactor parameter: each pipeline slot holds the largest one's master, beyond
    buffer_bytes. The plan's pinned RAM (given --largest-module) is what the optimizer pins, to the factors and
    alignment (under 1%)."""
    big = torch.zeros(1024, 1024, dtype=torch.bfloat16, requires_grad=True)  # 2 MiB of bf16: 4 MiB master
    small = torch.zeros(64, 64, dtype=torch.bfloat16, requires_grad=True)
    for p in (big, small):
        p.grad = torch.ones_like(p)
    buffer_bytes = 4 * (64 << 10)
    with OffloadAdafactor([big, small], offload="nvme", swap_dir=tmp_path / "swap", buffer_bytes=buffer_bytes) as opt:
        opt.step()
        pinned = opt.memory_report()["pinned_parts"]["state"]["bytes"]
    assert pinned > 4 * buffer_bytes  # the slots grew to the big parameter's master
    params = big.numel() + small.numel()
    rc, out, _ = run_cli(capsys, "plan", "--params", str(params), "--optimizer", "adafactor", "--buffer-bytes",
                         str(buffer_bytes), "--largest-module", str(big.numel() * 2), "--json")
    assert rc == 0
    result = json.loads(out)
    nvme = next(x for x in result["layouts"] if x["name"].startswith('no GPU, offload="nvme"'))
    weights_and_grads = params * 4
    assert nvme["ram"] - weights_and_grads == pytest.approx(pinned, rel=0.01)
    assert result["offloaded_pinned"]["state"] == pytest.approx(pinned, rel=0.01)
    rc, text, _ = run_cli(capsys, "plan", "--params", str(params), "--optimizer", "adafactor", "--buffer-bytes",
                          str(buffer_bytes))
    assert rc == 0 and "largest parameter" in text  # without --largest-module: says what it leaves out
