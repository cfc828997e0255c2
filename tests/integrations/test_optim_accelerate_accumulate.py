"""swapio's optimizers under accelerate's training loop, against the same script with torch's optimizer on a
resident model: prepare(model, opt, dataloader, scheduler), `with accelerator.accumulate(model)` with
gradient_accumulation_steps > 1 (AcceleratedOptimizer skips step and zero_grad until sync_gradients),
accelerator.clip_grad_norm_ / clip_grad_value_ (opt.clip_grad_norm_ for an offloaded model), bf16 autocast on
the CPU, transformers' and torch's schedulers. OffloadAdamW is bit-equal to torch's fused AdamW where the moments
agree (docs/kernel.md): the comparison runs few steps and checks every output; a clip by value, which makes many
gradients equal, is compared within float32 rounding (test_optim_vs_torch_bits.py: moments may round apart).
Optimizers torch lacks (Lion, the bf16/int8 states) are compared with themselves on a resident model, bit for bit."""
import itertools

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, disk_offload, remove_offload  # noqa: E402

FUSED_BITS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loader():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=2)  # 5 batches: the last step ends with the loader


def _run(make_opt, tmp_path, offload=None, gas=1, clip=None, mixed_precision="no", sched="linear"):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=gas, mixed_precision=mixed_precision)
    model = _net()
    if offload == "disk":
        model = disk_offload(model, offload_dir=tmp_path / "od")
    elif offload == "cpu":
        model = cpu_offload(model)
    opt = make_opt(model.parameters())
    scheduler = (transformers.get_scheduler("linear", optimizer=opt, num_warmup_steps=2, num_training_steps=12)
                 if sched == "linear" else torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12))
    model, opt, loader, scheduler = accelerator.prepare(model, opt, _loader(), scheduler)
    outs, lrs = [], []
    for _ in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip == "norm":
                    if offload:
                        opt.optimizer.clip_grad_norm_(0.05)
                    else:
                        accelerator.clip_grad_norm_(model.parameters(), 0.05)
                if accelerator.sync_gradients and clip == "value":
                    accelerator.clip_grad_value_(model.parameters(), 0.01)
                opt.step()
                scheduler.step()
                opt.zero_grad()
            outs.append(loss.detach())
            lrs.append(opt.param_groups[0]["lr"])
    with torch.no_grad():
        outs.append(model(torch.ones(3, 8)).float())
    if hasattr(opt.optimizer, "close"):
        opt.optimizer.close()
    if offload:
        remove_offload(accelerator.unwrap_model(model))
    return outs, lrs


def _assert_same(got, want, exact):
    assert got[1] == want[1]  # the scheduler stepped as often: only when the optimizer did
    for g, w in zip(got[0], want[0]):
        if exact:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _opt(mode, tmp_path, cls=so.OffloadAdamW, **kw):
    extra = {"swap_dir": tmp_path / "swap", "buffer_bytes": 3 << 16, "buffer_count": 3} if mode == "nvme" else {}
    return lambda params: cls(params, offload=mode, **extra, **kw)


CASES = [(gas, clip, mp) for gas, clip, mp in itertools.product([1, 3], [None, "norm", "value"], ["no", "bf16"])]


@pytest.mark.parametrize("gas,clip,mp", CASES, ids=[f"gas{g}-{c}-{m}" for g, c, m in CASES])
@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_adamw_under_accelerate_matches_torch_adamw(mode, gas, clip, mp, tmp_path):
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    exact = FUSED_BITS and clip != "value"
    want = _run(lambda ps: torch.optim.AdamW(ps, fused=exact, foreach=False if not exact else None, **kw), tmp_path,
                gas=gas, clip=clip, mixed_precision=mp)
    _assert_same(_run(_opt(mode, tmp_path, **kw), tmp_path, gas=gas, clip=clip, mixed_precision=mp), want, exact)
    if clip != "value":  # clip_grad_value_ cannot reach an offloaded weight's gradient (a RuntimeError, tested below)
        got = _run(_opt(mode, tmp_path, **kw), tmp_path, offload="disk", gas=gas, clip=clip, mixed_precision=mp)
        _assert_same(got, want, exact)


OTHERS = {
    "adam-amsgrad": (lambda mode, tmp: _opt(mode, tmp, so.OffloadAdam, lr=1e-2, amsgrad=True),
                     lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False)),
    "adafactor": (lambda mode, tmp: _opt(mode, tmp, so.OffloadAdafactor, lr=1e-2),
                  lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=False)),
    "lion": (lambda mode, tmp: _opt(mode, tmp, so.OffloadLion, lr=1e-3, weight_decay=0.1), None),
    "adamw-bf16-state": (lambda mode, tmp: _opt(mode, tmp, lr=1e-2, state_dtype="bf16"), None),
    "adamw-int8-state": (lambda mode, tmp: _opt(mode, tmp, lr=1e-2, state_dtype="int8"), None),
}


@pytest.mark.parametrize("offload", [None, "disk", "cpu"])
@pytest.mark.parametrize("name", list(OTHERS))
def test_other_optimizers_under_accelerate_accumulate(name, offload, tmp_path):
    """Against torch's where it has one (within float32 rounding), else against the same optimizer in cpu mode on
    the resident model (bit for bit); nvme mode and an offloaded model give the same numbers as that."""
    ours, torch_opt = OTHERS[name]
    adafactor = name == "adafactor"  # no betas for OneCycleLR to cycle (torch's Adafactor neither)
    args = {"gas": 3, "clip": None if adafactor else "norm", "mixed_precision": "bf16",
            "sched": "linear" if adafactor else "onecycle"}
    base = _run(ours("cpu", tmp_path), tmp_path, **args)
    if torch_opt is not None and offload is None:
        _assert_same(base, _run(torch_opt, tmp_path, **args), exact=False)
    _assert_same(_run(ours("nvme", tmp_path), tmp_path, offload=offload, **args), base, exact=True)


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_accelerators_clipping_of_an_offloaded_model_names_opt_clip_grad_norm(offload, tmp_path):
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = _net()
    model = disk_offload(model, offload_dir=tmp_path / "od") if offload == "disk" else cpu_offload(model)
    model, opt = accelerator.prepare(model, so.OffloadAdamW(model.parameters(), lr=1e-2))
    accelerator.backward(model(torch.ones(2, 8)).square().mean())
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"register_hook"):
        accelerator.clip_grad_value_(model.parameters(), 1.0)
    opt.optimizer.close()
    remove_offload(model)
