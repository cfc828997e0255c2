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
