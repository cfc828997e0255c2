"""save_checkpoint of an offloaded model while another thread runs a forward of it (a server saving while it
answers). The check for replaced weights took the running module's fetched weights for a replacement: the save
failed ("was replaced between forwards") and put the placeholder back under the running forward, which failed on
meta values. The check waits for that module's forward; the save and the forward both give the resident model's
values."""
import threading

import pytest
import torch

from safetensors.torch import load_file
from swapio.offload import cpu_offload, disk_offload, save_checkpoint


class Gated(torch.nn.Module):
    """A layer whose forward, with its weights fetched, waits until the save has started."""

    def __init__(self, started, go):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))
        self.started, self.go = [started], [go]  # in lists: not deep-copied state of the module

    def forward(self, x):
        self.started[0].set()
        assert self.go[0].wait(30)
        return x @ self.weight


def _model(started, go):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), Gated(started, go), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_save_checkpoint_while_another_thread_runs_the_model(tmp_path, how):
    ready = threading.Event()
    ready.set()
    resident = _model(threading.Event(), ready)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = resident(x)
    started, go = threading.Event(), threading.Event()
    model = _model(started, go)
    model = disk_offload(model, tmp_path / "off") if how == "disk" else cpu_offload(model)
    results = []

    def run():
        try:
            with torch.no_grad():
                results.append(model(x))
        except BaseException as e:  # reported below
            results.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(30)
    saver = threading.Thread(target=lambda: results.append(save_checkpoint(model, tmp_path / "ckpt.safetensors")))
    saver.start()
    saver.join(0.5)  # waits on the running module's forward
    go.set()
    worker.join(30)
    saver.join(30)
    outputs = [r for r in results if isinstance(r, (torch.Tensor, BaseException))]
    assert len(outputs) == 1 and isinstance(outputs[0], torch.Tensor) and torch.equal(outputs[0], expected)
    saved = load_file(str(tmp_path / "ckpt.safetensors"))
    assert saved.keys() == resident.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in resident.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(x), expected)
