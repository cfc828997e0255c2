"""SWAPIO_ENGINE=null makes engine="auto" (every default handle) open the null engine, which moves no data. What
stores data refused engine="null" passed to it, but not the same engine forced from the environment: an nvme
optimizer, a checkpoint, disk_offload and load_file went on and lost or invented the data silently (SwapStore
refused it, pointing at an engine= nobody passed)."""
import pytest
import torch

swapio = pytest.importorskip("swapio")

CALLS = {
    "SwapStore": lambda tmp: swapio.SwapStore(tmp / "s"),
    "OffloadAdamW": lambda tmp: swapio.optim.OffloadAdamW(torch.nn.Linear(2, 2).parameters(), offload="nvme",
                                                          swap_dir=tmp / "opt"),
    "checkpoint.save": lambda tmp: swapio.checkpoint.save({"t": torch.ones(4)}, tmp / "c.safetensors"),
    "checkpoint.async_save": lambda tmp: swapio.checkpoint.async_save({"t": torch.ones(4)},
                                                                      tmp / "c.safetensors").wait(),
    "disk_offload": lambda tmp: swapio.offload.disk_offload(torch.nn.Linear(2, 2), tmp / "od", "cpu"),
    "save_checkpoint": lambda tmp: swapio.offload.save_checkpoint(torch.nn.Linear(2, 2), tmp / "m.safetensors"),
    "offload_activations": lambda tmp: swapio.offload.offload_activations("nvme", swap_dir=tmp / "act"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_swapio_engine_null_is_refused_where_data_is_stored(tmp_path, monkeypatch, call):
    monkeypatch.setenv("SWAPIO_ENGINE", "null")
    with pytest.raises(ValueError, match=r"engine='null' moves none.*SWAPIO_ENGINE=null"):
        CALLS[call](tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing made


def test_load_refused_with_swapio_engine_null(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save({"t": torch.arange(4.0)}, path)
    monkeypatch.setenv("SWAPIO_ENGINE", "null")
    for load in (swapio.checkpoint.load, swapio.offload.load_file):
        with pytest.raises(ValueError, match="SWAPIO_ENGINE=null"):
            load(path)
    monkeypatch.setenv("SWAPIO_ENGINE", "psync")  # a data engine forced from the environment still works
    assert torch.equal(swapio.checkpoint.load(path)["t"], torch.arange(4.0))
