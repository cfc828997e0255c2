"""remove_offload(model) while another thread runs the model (a generate() in progress). It took the weights out
from under the running forward: with disk_offload the other thread failed on a closed handle and put meta
placeholders back into the model remove_offload had just made resident (every later call failed); with
cpu_offload remove_offload said the weights had been replaced. It is a RuntimeError that says a forward is
running, and the running call finishes with the resident model's output; once calls have returned, remove_offload
works."""
import threading

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload


class Gated(torch.nn.Module):
    """A layer whose forward waits for the test, with its weights fetched."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))
        self.started, self.go = threading.Event(), threading.Event()

    def forward(self, x):
        self.started.set()
        assert self.go.wait(30)
        return x @ self.weight


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), Gated(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_remove_offload_while_another_thread_runs_the_model(tmp_path, how):
    resident = _model()
    resident[1].go.set()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = resident(x)
    model = _model()  # the same weights (seeded)
    model = disk_offload(model, tmp_path / "off") if how == "disk" else cpu_offload(model)
    results = []

    def run():
        with torch.no_grad():
            results.append(model(x))

    worker = threading.Thread(target=run)
    worker.start()
    assert model[1].started.wait(30)
    try:
        with pytest.raises(RuntimeError, match="remove_offload(.|\n)*runs a forward"):
            remove_offload(model)
    finally:
        model[1].go.set()
        worker.join(30)
    assert len(results) == 1 and torch.equal(results[0], expected)
    remove_offload(model)  # calls have returned
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert isinstance(model[1].weight, torch.nn.Parameter) and model[1].weight.device.type == "cpu"


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_a_ctrl_c_as_a_forward_is_counted_does_not_keep_remove_offload_refused(tmp_path, how, monkeypatch):
    """A KeyboardInterrupt delivered as begin_call returns (between two bytecodes, before the caller's try) left
    the forward counted for good: every later remove_offload said a forward was running."""
    from swapio.offload import streamer as streamer_module
    model = _model()
    model[1].go.set()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    model = disk_offload(model, tmp_path) if how == "disk" else cpu_offload(model)
    real = streamer_module.WeightStreamer.begin_call

    def interrupted(self, *args):
        real(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(streamer_module.WeightStreamer, "begin_call", interrupted)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(x)
    monkeypatch.setattr(streamer_module.WeightStreamer, "begin_call", real)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    remove_offload(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
