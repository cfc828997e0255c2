"""Child side of test_offload_train_budget: two training steps of a small offloaded model (disk_offload +
OffloadAdamW), reporting the growth of the process's peak RSS, swapio's pinned accounting (every pinned block
alive, core/pinned.py) and the optimizer's memory_report(). Imported once by the fork server (preload)."""
import json
import os

import torch

from helpers.rss_child import reset_peak, status
from swapio.core.pinned import pinned_bytes
from swapio.offload import disk_offload
from swapio.optim import OffloadAdamW


VOCAB, DIM, TOKENS = 4096, 256, 8
RING, BUDGET = 2 << 20, 1 << 20  # disk_offload's buffer_bytes; the optimizer's buffer_bytes


class Net(torch.nn.Module):
    """An embedding (the largest record, 2 MiB in bf16), `layers` MLP blocks of two 0.5 MiB records each, and an
    untied head as large as the embedding: a decoder's shape, in miniature."""

    def __init__(self, layers):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))
            for _ in range(layers))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _allocations_of_64_kib_and_more_from_mmap():
    """glibc keeps freed heap memory of each thread's arena for reuse, so how much of it the peak RSS shows depends
    on how the in-backward worker's allocations interleaved with the main thread's (a run on a loaded machine grew
    19 MiB more at 14 layers than at 2). With larger blocks mmapped, and unmapped when freed, the peak is of what
    is alive: what the test is about."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD
    except OSError:
        pass  # not glibc: its allocator's own behaviour


def train(layers, mode, directory, result_path):
    """mode: "accumulate" (nvme, gradient sums in a file), "in_backward" (nvme) or "cpu" (state and sums in RAM)."""
    _allocations_of_64_kib_and_more_from_mmap()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    warm = Net(1).to(torch.bfloat16)  # one-time costs that are not swapio's (kernels, autograd) come first
    torch.nn.functional.cross_entropy(warm(ids).float().view(-1, VOCAB), ids.view(-1)).backward()
    del warm
    model = disk_offload(Net(layers).to(torch.bfloat16), offload_dir=f"{directory}/od", buffer_bytes=RING)
    extra = {}
    if mode != "cpu":
        extra["swap_dir"] = f"{directory}/swap"
        os.makedirs(extra["swap_dir"])
    opt = OffloadAdamW(model.parameters(), lr=1e-3, offload="nvme" if mode != "cpu" else "cpu",
                       in_backward=mode == "in_backward", buffer_bytes=BUDGET, **extra)
    baseline = status("VmRSS")
    reset = reset_peak()
    pinned_before = pinned_bytes(reset_peak=True)[0]
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(ids).float().view(-1, VOCAB), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    peak = status("VmHWM")
    pinned_now, pinned_peak = pinned_bytes()
    report = opt.memory_report()
    opt.close()
    with open(result_path, "w") as f:
        json.dump({"growth": peak - baseline, "reset": reset, "pinned_before": pinned_before,
                   "pinned_now": pinned_now, "pinned_peak": pinned_peak, "report": report}, f)
