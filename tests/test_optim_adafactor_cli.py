"""`swapio plan --optimizer adafactor` (bytes per parameter: the master only) and `swapio demo --optimizer
adafactor` (torch.optim.Adafactor beside OffloadAdafactor in both modes), checked against a measured optimizer."""
import json
import os

import pytest
import torch

from swapio.optim import OffloadAdafactor
from swapio.tools import demo, memplan
from _cli_helpers import run_cli


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
