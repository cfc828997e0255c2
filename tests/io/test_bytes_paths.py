"""Every public path argument takes a bytes path (and an os.PathLike giving bytes) as open() does, as disk_offload,
checkpoint.save and the optimizers' swap_dir do: SwapStore, OffloadOptimizer.save/load, offload.save_checkpoint
and load_file raised an opaque TypeError from joining str names to it ("Can't mix strings and bytes")."""
import os

import pytest
import torch

swapio = pytest.importorskip("swapio")


class _BytesPathLike:
    def __init__(self, path):
        self.path = os.fsencode(path)

    def __fspath__(self):
        return self.path


FORMS = {"bytes": os.fsencode, "bytes PathLike": _BytesPathLike}


@pytest.fixture(params=sorted(FORMS))
def as_bytes(request):
    return FORMS[request.param]


def test_swapstore(tmp_path, as_bytes):
    store = swapio.SwapStore(as_bytes(tmp_path / "s"))
    try:
        assert store.directory == str(tmp_path / "s")
        t = torch.arange(6.0)
        back = store.swap_out(t, release=False).swap_in().result()
        assert torch.equal(back, t)
        assert "tensor0.swap" in os.listdir(tmp_path / "s")
    finally:
        store.close()


def _stepped():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_save_and_load(tmp_path, as_bytes):
    model, opt = _stepped()
    expected = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    opt.save(as_bytes(tmp_path / "opt"))
    opt.close()
    assert os.path.isdir(tmp_path / "opt")
    fresh = swapio.optim.OffloadAdamW(model.parameters(), lr=0.1)
    fresh.load(as_bytes(tmp_path / "opt"))
    got = fresh.state_dict()["state"][0]
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    fresh.close()


def test_save_checkpoint_and_load_file(tmp_path, as_bytes):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    written = swapio.offload.save_checkpoint(model, as_bytes(tmp_path / "m.safetensors"))
    assert written == str(tmp_path / "m.safetensors")
    loaded = swapio.offload.load_file(as_bytes(tmp_path / "m.safetensors"))
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
