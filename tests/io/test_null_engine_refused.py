"""engine="null" moves no data (it measures swapio's overhead in benchmarks; `swapio tune` refuses it too). Given
to what stores data, it lost it silently: SwapStore's swap_in gave uninitialised memory, a checkpoint saved with
such a handle did not load, an optimizer's nvme state and offloaded activations came back as garbage."""
import pytest
import torch

swapio = pytest.importorskip("swapio")


def _null():
    return swapio.AioHandle(engine="null")


def _with_null_handle(call):
    h = _null()
    try:
        call(h)
    finally:
        h.close()


def _activations(tmp):
    with swapio.offload.offload_activations("nvme", swap_dir=tmp / "act", engine="null"):
        pass


CALLS = {
    "SwapStore(engine=)": lambda tmp: swapio.SwapStore(tmp / "s", engine="null"),
    "SwapStore(handle=)": lambda tmp: _with_null_handle(lambda h: swapio.SwapStore(tmp / "s", handle=h)),
    "checkpoint.save": lambda tmp: _with_null_handle(
        lambda h: swapio.checkpoint.save({"t": torch.ones(4)}, tmp / "c.safetensors", handle=h)),
    "checkpoint.async_save": lambda tmp: _with_null_handle(
        lambda h: swapio.checkpoint.async_save({"t": torch.ones(4)}, tmp / "c.safetensors", handle=h).wait()),
    "disk_offload": lambda tmp: _with_null_handle(
        lambda h: swapio.offload.disk_offload(torch.nn.Linear(2, 2), tmp / "od", "cpu", handle=h)),
    "OffloadAdamW": lambda tmp: swapio.optim.OffloadAdamW(torch.nn.Linear(2, 2).parameters(), offload="nvme",
                                                          swap_dir=tmp / "opt", engine="null"),
    "offload_activations": _activations,
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_engine_null_is_refused_where_data_is_stored(tmp_path, call):
    with pytest.raises(ValueError, match="engine='null' moves none"):
        CALLS[call](tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing made
