"""An empty path is a ValueError naming the argument, before anything is written: as a directory it meant the
current one (SwapStore's swap files, disk_offload's weight files left there after remove_offload, save_checkpoint's
shards), an unset environment variable's doing most likely; torch.save("") and os.makedirs("") refuse it too."""
import os

import pytest
import torch

swapio = pytest.importorskip("swapio")

CALLS = {
    "SwapStore": ("directory", lambda: swapio.SwapStore("").close()),
    "disk_offload": ("offload_dir", lambda: swapio.offload.disk_offload(torch.nn.Linear(2, 2), "", "cpu")),
    "save_checkpoint": ("path", lambda: swapio.offload.save_checkpoint(torch.nn.Linear(2, 2), "")),
    "checkpoint.save": ("path", lambda: swapio.checkpoint.save({"t": torch.ones(2)}, "")),
    "checkpoint.async_save": ("path", lambda: swapio.checkpoint.async_save({"t": torch.ones(2)}, b"").wait()),
    "load_file": ("checkpoint", lambda: swapio.offload.load_file("")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_empty_path_is_a_value_error_and_writes_nothing(tmp_path, monkeypatch, call):
    monkeypatch.chdir(tmp_path)
    name, run = CALLS[call]
    with pytest.raises(ValueError, match=f"^{name} is an empty path"):
        run()
    assert os.listdir(tmp_path) == []
