"""The garbage collector freeing a graph caught in a reference cycle (a traceback's frames, a dict holding
itself) while the offload is inside its own save: autograd's drop of that graph's saved tensors then ran in the
middle of the save. In a `with` around the training loop, the last drop reset the swap file under the save in
progress, and the forward's next tensors were written over its bytes: a silently wrong gradient. The drops now
wait for the save to end."""
import gc

import torch

from helpers.activations import swap_files
from swapio.offload import offload_activations

N = 256  # 256 KiB a saved storage


def leaf():
    return torch.randn(N, N, generator=torch.Generator().manual_seed(0)).requires_grad_(True)


def forward(x):
    return (x * 2).tanh().exp().sin().cos().tanh().sigmoid().sum()  # each op saves a storage of its own


def test_a_graph_freed_by_the_collector_inside_a_save_leaves_the_saves_their_bytes(tmp_path, monkeypatch):
    x = leaf()
    forward(x).backward()
    want, x.grad = x.grad, None
    act = offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0, staging_bytes=0)
    real, collected = act._res.handle.pwrite, []

    def collecting(*args, **kwargs):
        write = real(*args, **kwargs)
        if not collected:  # the collector runs at some allocation inside the first save of the step
            collected.append(gc.collect())
        return write
    gc.disable()  # (so that it runs just there, nowhere before)
    try:
        with act:  # a `with` around the training loop
            cycle = {"graph": (x * 5).sin()}  # a step whose graph, caught in a cycle, was left without backward
            cycle["self"] = cycle
            del cycle
            monkeypatch.setattr(act._res.handle, "pwrite", collecting)
            loss = forward(x)
            monkeypatch.setattr(act._res.handle, "pwrite", real)
            loss.backward()
    finally:
        gc.enable()
    assert collected and collected[0] > 0
    assert torch.equal(x.grad, want)
    del loss
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()
