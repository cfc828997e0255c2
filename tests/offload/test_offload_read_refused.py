"""A read of an offloaded weight refused at submission (out of descriptors, EMFILE; a replaced file, ESTALE): the
forward fails with that error, and the ring region taken for the read goes back (it stayed taken for good, and
the ring ran one record short from then on: fetches fell back to pinning temporary buffers)."""
import errno

import pytest
import torch

from swapio.offload import disk_offload, remove_offload
from swapio.offload.api import _offloaded
from swapio.offload.layout import round_up

WIDTH, LAYERS = 64, 4
LAYER = WIDTH * WIDTH * 4


class _RefusingSecondRead:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pread(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.inner.pread(*args, **kwargs)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_read_refused_at_submission_gives_its_ring_region_back(tmp_path, prefetch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    model.requires_grad_(False)
    x = torch.randn(3, WIDTH)
    want = model(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=2 * LAYER, prefetch=prefetch)
    fetcher = _offloaded[model].fetcher
    fetcher.handle = _RefusingSecondRead(fetcher.handle)
    with pytest.raises(OSError, match="Too many open files"):
        model(x)
    ring = sum(round_up(f.record.nbytes) for f in fetcher.fetches.values() if f.alloc[0] == "ring")
    assert fetcher.ring.in_use == ring
    for _ in range(2):  # the next forwards as before, through the whole ring
        assert torch.equal(model(x), want)
    assert fetcher.stats["temp"] == 0
    fetcher.handle = fetcher.handle.inner
    remove_offload(model)
