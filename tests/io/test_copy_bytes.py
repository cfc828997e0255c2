"""_C.copy_bytes (the streaming copy behind async_save's capture and the handle's bounce buffers): every byte
lands, at every destination and source misalignment and size around its 16-byte, 64-byte and page edges, and
nothing outside the destination range is written."""
import pytest
import torch

from swapio import _C


@pytest.mark.parametrize("nbytes", [0, 1, 15, 63, 4095, 4096, 4097, 4096 + 63, (1 << 20) + 3])
@pytest.mark.parametrize("dst_shift", [0, 1, 8, 15])
@pytest.mark.parametrize("src_shift", [0, 3])
def test_copy_bytes_copies_exactly_the_range(nbytes, dst_shift, src_shift):
    g = torch.Generator().manual_seed(nbytes + dst_shift)
    src_store = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=g)
    dst_store = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8)
    src = src_store[src_shift:src_shift + nbytes]
    dst = dst_store[dst_shift:dst_shift + nbytes]
    _C.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes)
    assert torch.equal(dst, src)
    assert bool((dst_store[:dst_shift] == 0xA5).all()) and bool((dst_store[dst_shift + nbytes:] == 0xA5).all())


def test_copy_bytes_refuses_a_null_pointer():
    t = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="null pointer"):
        _C.copy_bytes(0, t.data_ptr(), 16)
