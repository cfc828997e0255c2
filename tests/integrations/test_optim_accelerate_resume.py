"""accelerate's checkpointing of swapio's optimizers, as its examples resume: ProjectConfiguration with
automatic_checkpoint_naming (save_state() / load_state() without a path), register_for_checkpointing of an
extra object (the step counter), a resume mid-epoch with skip_first_batches, gradient accumulation, bf16
weights under bf16 autocast. The resumed run ends bit-identical to the uninterrupted one, as with torch's AdamW
(checked by the same script); an offloaded model, left out of prepare, resumes through its optimizer, also with
in_backward=True."""
import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import disk_offload, remove_offload  # noqa: E402

BATCHES, EPOCHS = 6, 2


class Counter:
    """An extra object with state, registered for checkpointing: the number of batches seen."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _loader():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(2 * BATCHES, 8, generator=g),
                                          torch.randn(2 * BATCHES, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=2)


def _run(make_opt, project, *, offload=False, gas=1, dtype=None, save_at=None, resume=False):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gas, mixed_precision="bf16" if dtype else "no",
                              project_config=ProjectConfiguration(project_dir=str(project),
                                                                  automatic_checkpoint_naming=True, total_limit=2))
    torch.manual_seed(1 if resume else 0)  # the resumed run starts from other weights: the checkpoint sets them
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if dtype:
        model = model.to(dtype)
    if offload:
        model = disk_offload(model, offload_dir=project / ("od-resumed" if resume else "od"))
    opt = make_opt(model.parameters())
    scheduler = transformers.get_scheduler("cosine", optimizer=opt, num_warmup_steps=2, num_training_steps=12)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if offload:  # its state_dict() holds placeholders: the optimizer carries its weights (docs/guide.md)
        opt, loader, scheduler = accelerator.prepare(opt, _loader(), scheduler)
    else:
        model, opt, loader, scheduler = accelerator.prepare(model, opt, _loader(), scheduler)
    start, skip = 0, 0
    if resume:
        accelerator.load_state()  # the latest of the automatically named checkpoints
        start, skip = divmod(counter.n, len(loader))
    losses = []
    for epoch in range(start, EPOCHS):
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for x, y in batches:
            if counter.n == save_at:
                accelerator.save_state()
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x.to(dtype or x.dtype)).float(), y)
                accelerator.backward(loss)
                opt.step()
                scheduler.step()
                opt.zero_grad()
            counter.n += 1
            losses.append(loss.item())
    with torch.no_grad():
        out = model(torch.ones(3, 8, dtype=dtype or torch.float32))
    if hasattr(opt.optimizer, "close"):
        opt.optimizer.close()
    if offload:
        remove_offload(model)
    return out, losses


def _swap(tmp_path):
    return {"swap_dir": tmp_path / "swap", "buffer_bytes": 3 << 16, "buffer_count": 3}


OPTIMIZERS = {
    "torch-adamw": lambda tmp: lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-cpu": lambda tmp: lambda ps: so.OffloadAdamW(ps, lr=1e-2),
    "adamw-nvme": lambda tmp: lambda ps: so.OffloadAdamW(ps, lr=1e-2, offload="nvme", **_swap(tmp)),
    "adamw-nvme-int8": lambda tmp: lambda ps: so.OffloadAdamW(ps, lr=1e-2, offload="nvme", state_dtype="int8",
                                                              **_swap(tmp)),
    "adam-amsgrad": lambda tmp: lambda ps: so.OffloadAdam(ps, lr=1e-2, amsgrad=True),
    "adamw-bf16": lambda tmp: lambda ps: so.OffloadAdamW(ps, lr=1e-2, state_dtype="bf16"),
    "lion-nvme-bf16": lambda tmp: lambda ps: so.OffloadLion(ps, lr=1e-3, offload="nvme", state_dtype="bf16",
                                                            **_swap(tmp)),
    "adafactor-nvme": lambda tmp: lambda ps: so.OffloadAdafactor(ps, lr=1e-2, offload="nvme", **_swap(tmp)),
}
# (offloaded model, accumulation steps, weights' dtype, batch the checkpoint is taken before: a step boundary)
SETUPS = {"resident-gas2": (False, 2, None, 8), "resident-bf16": (False, 1, torch.bfloat16, 9),
          "offloaded-gas2": (True, 2, None, 4), "offloaded-bf16": (True, 1, torch.bfloat16, 7)}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_save_state_load_state_resume_mid_epoch_bit_identically(name, setup, tmp_path):
    offload, gas, dtype, save_at = SETUPS[setup]
    if offload and name.startswith("torch"):
        pytest.skip("torch's optimizers cannot train an offloaded model")
    make = OPTIMIZERS[name](tmp_path)
    full = _run(make, tmp_path, offload=offload, gas=gas, dtype=dtype, save_at=save_at)
    resumed = _run(make, tmp_path, offload=offload, gas=gas, dtype=dtype, resume=True)
    assert resumed[1] == full[1][save_at:]
    torch.testing.assert_close(resumed[0], full[0], rtol=0, atol=0)


@pytest.mark.parametrize("opt_cls", [so.OffloadAdamW, so.OffloadLion])
def test_in_backward_on_an_offloaded_model_resumes_as_the_accumulating_mode(opt_cls, tmp_path):
    lr = 1e-3 if opt_cls is so.OffloadLion else 1e-2
    want = _run(lambda ps: opt_cls(ps, lr=lr), tmp_path / "a", offload=True, save_at=7)
    full = _run(lambda ps: opt_cls(ps, lr=lr, in_backward=True), tmp_path / "b", offload=True, save_at=7)
    resumed = _run(lambda ps: opt_cls(ps, lr=lr, in_backward=True), tmp_path / "b", offload=True, resume=True)
    for got in (full, resumed):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert resumed[1] == want[1][7:]
