"""A model offloaded and dropped without remove_offload is garbage collected, whatever holds its forward wrappers:
the streamer's finalizer keeps the fetcher, whose records reach the units, so a unit must not hold its module or
anything that does (its OffloadedForward holds the module's forward) other than weakly."""
import gc
import weakref

import pytest
import torch

from swapio.offload import cpu_offload, disk_offload


class Root(torch.nn.Module):
    """A root that owns a weight directly (it is a unit too), over a child module."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(2))
        self.lin = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_dropped_offloaded_model_is_collected(kind, tmp_path):
    model = Root()
    model = cpu_offload(model) if kind == "cpu" else disk_offload(model, offload_dir=tmp_path / "od")
    with torch.no_grad():
        model(torch.ones(1, 8))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_dropped_offloaded_models_weights_bookkeeping_is_collected(kind, tmp_path):
    """Not only the model: its weights' placeholders (and with them the slots, records and units that describe
    them) go too. A process-wide table from placeholders to their slots, meant to be emptied by remove_offload,
    held every dropped model's slots, whose placeholders kept their own entries alive: each model offloaded and
    dropped in a long-running process (a notebook rebuilding it) stayed in memory for good."""
    model = Root()
    model = cpu_offload(model) if kind == "cpu" else disk_offload(model, offload_dir=tmp_path / "od")
    with torch.no_grad():
        model(torch.ones(1, 8))
    refs = [weakref.ref(p) for p in model.parameters()]
    assert len(refs) == 3
    del model
    gc.collect()  # the model and its streamer; the streamer's finalizer then lets go of what the next one frees
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
