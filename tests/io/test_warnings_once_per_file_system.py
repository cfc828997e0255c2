"""The O_DIRECT-fallback and RAM-backed warnings are given once per file system, not once per directory: each nvme
optimizer and each offload_activations(to="nvme") writes in a private directory of its own (a new name every
time), so a notebook that rebuilds them got one more warning per rebuild, and a long-running process kept one more
key per rebuild in swapio's set of warnings already given."""
import warnings

import torch

import swapio
import swapio.optim as so
from swapio.core import _errors
from swapio.offload import offload_activations

REBUILDS = 4


def _rebuild_and_use(ramfs_dir, i):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    opt = so.OffloadAdamW(model.parameters(), offload="nvme", swap_dir=ramfs_dir)
    act = offload_activations(to="nvme", swap_dir=ramfs_dir, min_bytes=0, staging_bytes=0)
    with act:
        loss = model(torch.randn(16, 64, requires_grad=True)).sum()
    loss.backward()
    opt.step()
    act.close()
    opt.close()
    store = swapio.SwapStore(ramfs_dir / f"store{i}")  # a new directory of the same file system each time
    store.swap_out(torch.randn(64)).wait()
    store.close()


def test_rebuilt_optimizers_and_activation_offloads_warn_once(ramfs_dir, fresh_warnings):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _rebuild_and_use(ramfs_dir, 0)
        given = len(_errors._warned)
        for i in range(1, REBUILDS + 1):
            _rebuild_and_use(ramfs_dir, i)
    messages = [str(w.message) for w in caught if issubclass(w.category, swapio.SwapioWarning)]
    assert sum("O_DIRECT" in m for m in messages) == 1, messages
    assert sum("lives in RAM" in m for m in messages) == 1, messages
    assert len(_errors._warned) == given  # nothing more kept per rebuild
