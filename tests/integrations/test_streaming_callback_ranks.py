"""StreamingCheckpointCallback writes the optimizer's checkpoint only in the process Trainer saves from
(args.should_save), as Trainer writes optimizer.pt and as SwapioCheckpointCallback does: under DDP every rank
holds the same full optimizer, and every rank called opt.save() on the one checkpoint-N/swapio-optim/: the same
bytes written world-size times, and a save overlapping another's refused with OSError(EBUSY) (the directory's
flock), which ended that rank's training at a checkpoint."""
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
from swapio.integrations.transformers import StreamingCheckpointCallback  # noqa: E402
from swapio.optim import OffloadAdamW  # noqa: E402


def _stepped_optimizer():
    model = torch.nn.Linear(4, 2)
    opt = OffloadAdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("should_save", [True, False])
def test_only_the_process_trainer_saves_from_writes_the_checkpoint(should_save, tmp_path):
    opt = _stepped_optimizer()
    args = SimpleNamespace(output_dir=str(tmp_path), save_only_model=False, should_save=should_save)
    StreamingCheckpointCallback().on_step_end(args, SimpleNamespace(global_step=2),
                                              SimpleNamespace(should_save=True), optimizer=opt)
    written = os.path.isdir(tmp_path / "checkpoint-2" / "swapio-optim")
    opt.close()
    assert written == should_save
