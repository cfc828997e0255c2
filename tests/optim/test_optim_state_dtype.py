"""state_dtype="bf16" / "int8" in OffloadAdamW, OffloadAdam and OffloadLion, in both offload modes.

References: the native kernel stepping whole-parameter state tensors directly (swapio.ops, with the seed and
element indices the optimizer documents: seed = the parameter's index, element i of the parameter), which the
optimizer must reproduce bit for bit however its backend slices the state; swapio.quant for the stored formats;
torch.optim.AdamW for the exported state dict.
"""
import warnings

import pytest
import torch

so = pytest.importorskip("swapio.optim", reason="swapio is not built (python setup.py build_ext --inplace)")
from swapio import ops, quant  # noqa: E402
from swapio.core._errors import SwapioWarning  # noqa: E402

SHAPES = [(40, 700), (3, 300), (513,), (1,)]  # 28000 elements span several 64 KiB chunks; blocks end mid-way
SMALL = {"buffer_bytes": 3 * (64 << 10), "buffer_count": 3}
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
STEPS = 4


def make_params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in SHAPES]


def grads(step, params, nan_at=None):
    gen = torch.Generator().manual_seed(100 + step)
    out = [(torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen).pow(4)).to(p.dtype)
           for p in params]
    if nan_at is not None:
        out[0].view(-1)[nan_at] = float("nan")
    return out


def make_opt(kind, params, offload, state_dtype, tmp_path, **extra):
    io = {"swap_dir": tmp_path, **SMALL} if offload == "nvme" else {}
    if kind == "lion":
        return so.OffloadLion(params, offload=offload, state_dtype=state_dtype, **LION, **io, **extra)
    return so.OffloadAdamW(params, offload=offload, state_dtype=state_dtype, **ADAMW, **io, **extra)


def run_opt(opt, params, steps=STEPS, first=1):
    for step in range(first, first + steps):
        for p, g in zip(params, grads(step, params)):
            p.grad = g
        opt.step()


def kernel_state(n, kind, state_dtype):
    names = ("exp_avg",) if kind == "lion" else ("exp_avg", "exp_avg_sq")
    out = {}
    for name in names:
        if state_dtype == "int8":
            out[name] = torch.zeros(n, dtype=torch.uint8)
            out[name + "_scale"] = torch.zeros(quant.num_blocks(n))
        else:
            out[name] = torch.zeros(n, dtype=torch.bfloat16 if state_dtype == "bf16" else torch.float32)
    return out


def run_kernel(kind, state_dtype, params, steps=STEPS):
    """The reference: each parameter's whole state stepped by the kernel, seed = its index."""
    masters = [p.detach().float().clone().view(-1) for p in params]
    states = [kernel_state(p.numel(), kind, state_dtype) for p in params]
    for step in range(1, steps + 1):
        for i, (m, st, g) in enumerate(zip(masters, states, grads(step, params))):
            g = g.view(-1)
            if kind == "lion":
                ops.lion_step_(m, g, st["exp_avg"], step=step, lr=LION["lr"], beta1=0.9, beta2=0.99,
                               weight_decay=LION["weight_decay"], exp_avg_scale=st.get("exp_avg_scale"), seed=i)
            else:
                ops.adam_step_(m, g, st["exp_avg"], st["exp_avg_sq"], step=step, lr=ADAMW["lr"], beta1=0.9,
                               beta2=0.999, eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], adamw=True,
                               exp_avg_scale=st.get("exp_avg_scale"), exp_avg_sq_scale=st.get("exp_avg_sq_scale"),
                               seed=i)
    return masters, states


def decoded(st, name):
    t = st[name]
    if t.dtype == torch.uint8:
        return quant.dequantize(t, st[name + "_scale"], signed=name == "exp_avg")
    return t.float()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("kind,state_dtype", [("adamw", "bf16"), ("adamw", "int8"), ("lion", "bf16"),
                                              ("lion", "int8")])
def test_steps_match_the_kernel_on_whole_parameters_bit_for_bit(kind, state_dtype, offload, tmp_path):
    params = make_params()
    with make_opt(kind, params, offload, state_dtype, tmp_path) as opt:
        run_opt(opt, params)
        masters, states = run_kernel(kind, state_dtype, make_params())
        exported = opt.state_dict()["state"]
        for i, p in enumerate(params):
            assert torch.equal(p.detach().view(-1), masters[i])
            for name in exported[i]:
                if name != "step":
                    assert torch.equal(exported[i][name].view(-1), decoded(states[i], name)), name
        if offload == "cpu":  # the stored arrays themselves, in optimizer.state as torch keeps state
            for i, p in enumerate(params):
                for name, ref in states[i].items():
                    assert opt.state[p][name].dtype == ref.dtype
                    assert torch.equal(opt.state[p][name].view(-1), ref), name


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_bf16_parameters_keep_an_fp32_master(state_dtype, tmp_path):
    params = make_params(torch.bfloat16)
    with make_opt("adamw", params, "nvme", state_dtype, tmp_path) as opt:
        run_opt(opt, params)
        masters, _ = run_kernel("adamw", state_dtype, make_params(torch.bfloat16))
        sd = opt.state_dict()["state"]
        for i, p in enumerate(params):
            assert torch.equal(sd[i]["master"].view(-1), masters[i])
            assert torch.equal(p.detach().view(-1), masters[i].to(torch.bfloat16))


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_state_dict_is_fp32_and_loads_into_torch_adamw(state_dtype, tmp_path):
    params = make_params()
    with make_opt("adamw", params, "nvme", state_dtype, tmp_path) as opt:
        run_opt(opt, params)
        sd = opt.state_dict()
    for st in sd["state"].values():
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert (st["exp_avg_sq"] >= 0).all()
    ref_params = [p.detach().clone().requires_grad_(True) for p in params]
    ref = torch.optim.AdamW(ref_params, **ADAMW)
    ref.load_state_dict(sd)  # torch's own AdamW takes it and steps from it
    for p, g in zip(ref_params, grads(STEPS + 1, ref_params)):
        p.grad = g
    ref.step()
    assert int(ref.state[ref_params[0]]["step"]) == STEPS + 1


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_an_fp32_state_dict_loaded_into_int8_is_quantised(offload, tmp_path):
    params = make_params()
    with make_opt("adamw", params, "cpu", "fp32", tmp_path) as fp32:
        run_opt(fp32, params)
        sd = fp32.state_dict()
        sd = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()},
              "param_groups": sd["param_groups"]}
    with make_opt("adamw", params, offload, "int8", tmp_path) as opt:
        opt.load_state_dict(sd)
        got = opt.state_dict()["state"]
        for i in sd["state"]:
            for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                codes, scale = quant.quantize(sd["state"][i][name], signed)
                assert torch.equal(got[i][name].view(-1), quant.dequantize(codes, scale, signed))
            assert torch.equal(got[i]["step"], sd["state"][i]["step"])


@pytest.mark.parametrize("save_mode,load_mode", [("cpu", "nvme"), ("nvme", "cpu"), ("nvme", "nvme")])
@pytest.mark.parametrize("kind,state_dtype", [("adamw", "int8"), ("adamw", "bf16"), ("lion", "int8")])
def test_save_load_resumes_bit_identically(kind, state_dtype, save_mode, load_mode, tmp_path):
    params = make_params()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with make_opt(kind, params, save_mode, state_dtype, tmp_path / "a") as opt:
        run_opt(opt, params, steps=2)
        opt.save(tmp_path / "ckpt")
        saved = [p.detach().clone() for p in params]
        run_opt(opt, params, steps=2, first=3)
        straight = [p.detach().clone() for p in params]
    resumed = [s.clone().requires_grad_(True) for s in saved]
    with make_opt(kind, resumed, load_mode, state_dtype, tmp_path / "b") as opt:
        opt.load(tmp_path / "ckpt")
        run_opt(opt, resumed, steps=2, first=3)
    for a, b in zip(resumed, straight):
        assert torch.equal(a.detach(), b)


def test_a_checkpoint_of_another_state_dtype_is_converted(tmp_path):
    params = make_params()
    with make_opt("adamw", params, "cpu", "fp32", tmp_path) as fp32:
        run_opt(fp32, params)
        fp32.save(tmp_path / "ckpt")
        sd = fp32.state_dict()
        ref = {i: {n: t.clone() for n, t in st.items()} for i, st in sd["state"].items()}
    with make_opt("adamw", params, "nvme", "int8", tmp_path) as opt:
        opt.load(tmp_path / "ckpt")
        got = opt.state_dict()["state"]
    for i, st in ref.items():
        codes, scale = quant.quantize(st["exp_avg_sq"], signed=False)
        assert torch.equal(got[i]["exp_avg_sq"].view(-1), quant.dequantize(codes, scale, signed=False))
    with make_opt("adamw", params, "cpu", "bf16", tmp_path) as opt:  # and back: int8 is not lost in between
        opt.load(tmp_path / "ckpt")
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], ref[0]["exp_avg"].to(torch.bfloat16).float())


def test_memory_report_counts_the_stored_bytes(tmp_path):
    n = sum(torch.Size(s).numel() for s in SHAPES)
    per_param = {}
    for state_dtype in ("fp32", "bf16", "int8"):
        params = make_params()
        with make_opt("adamw", params, "cpu", state_dtype, tmp_path) as opt:
            run_opt(opt, params, steps=1)
            report = opt.memory_report()
        assert report["params"] == n and report["state_dtype"] == state_dtype
        per_param[state_dtype] = report["bytes_per_param"]
    assert per_param["fp32"] == 8  # fp32 parameters are their own master: two fp32 moments
    assert per_param["bf16"] == 4
    blocks = sum(quant.num_blocks(torch.Size(s).numel()) for s in SHAPES)
    assert per_param["int8"] == (2 * n + 2 * 4 * blocks) / n
    big = torch.zeros(1 << 20, requires_grad=True)
    with so.OffloadAdamW([big], offload="nvme", swap_dir=tmp_path, state_dtype="int8", buffer_bytes=4 << 20) as opt:
        big.grad = torch.ones_like(big)
        opt.step()
        report = opt.memory_report()
        assert report["state_bytes"] == (tmp_path / opt.swap_path / "state.swap").stat().st_size
        assert report["io_bytes_per_step"] == 2 * report["state_bytes"]
        assert 2 + 8 / 256 <= report["bytes_per_param"] < 2 + 8 / 256 + 0.01  # + 4 KiB padding of a few chunks
        assert 0 < report["pinned_bytes"] <= 4 << 20


def test_unknown_state_dtype_and_amsgrad_with_small_state_raise_value_error():
    params = make_params()
    with pytest.raises(ValueError, match=r"state_dtype must be one of \['fp32', 'bf16', 'int8'\]"):
        so.OffloadAdamW(params, state_dtype="fp16")
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        so.OffloadLion(params, state_dtype="int4")
    for state_dtype in ("bf16", "int8"):
        with pytest.raises(ValueError, match="amsgrad needs state_dtype='fp32'"):
            so.OffloadAdam(params, amsgrad=True, state_dtype=state_dtype)
    opt = so.OffloadAdamW(params[:2], state_dtype="int8")
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": params[2:], "amsgrad": True})
    assert len(opt.param_groups) == 1  # the refused group was not kept
    fp32_amsgrad = so.OffloadAdamW(params, amsgrad=True)
    run_opt(fp32_amsgrad, params, steps=1)
    with pytest.raises(ValueError, match="amsgrad"):
        so.OffloadAdamW(params, state_dtype="int8").load_state_dict(fp32_amsgrad.state_dict())


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_int8_nan_gradient_warns_and_keeps_the_rest_of_its_block(offload, tmp_path):
    """A NaN gradient element: its moments are stored as 0 and left out of the block's scale, so the other 255
    elements of its block keep the values the kernel gives without the NaN; the parameter element itself
    becomes NaN, as with torch's AdamW (documented in docs/optim.md)."""
    params, clean = make_params(), make_params()
    with make_opt("adamw", params, offload, "int8", tmp_path) as opt, \
            make_opt("adamw", clean, "cpu", "int8", tmp_path) as ref:
        for p, g in zip(params, grads(1, params, nan_at=5)):
            p.grad = g
        for p, g in zip(clean, grads(1, clean)):
            p.grad = g
        with pytest.warns(SwapioWarning, match="1 moment value"):
            opt.step()
        ref.step()
        got, want = opt.state_dict()["state"][0], ref.state_dict()["state"][0]
    assert got["exp_avg"].view(-1)[5] == 0 and got["exp_avg_sq"].view(-1)[5] == 0
    assert torch.isnan(params[0].detach().view(-1)[5])
    block = torch.arange(256) != 5
    for name in ("exp_avg", "exp_avg_sq"):
        a, b = got[name].view(-1)[:256][block], want[name].view(-1)[:256][block]
        assert torch.isfinite(a).all()
        # the block's scale is the absmax of the finite values; with element 5 gone it may shrink, so the
        # others are re-coded on a finer grid: equal to the clean run within one code step of the clean scale
        assert (a - b).abs().max() <= 0.1 * b.abs().max()


def test_no_warning_without_non_finite_values(tmp_path):
    params = make_params()
    with make_opt("adamw", params, "cpu", "int8", tmp_path) as opt, warnings.catch_warnings():
        warnings.simplefilter("error", SwapioWarning)
        run_opt(opt, params, steps=2)


@pytest.mark.parametrize("kind", ["adamw", "lion"])
@pytest.mark.parametrize("edit", ["zero_", "replaced"])
def test_int8_codes_changed_outside_the_optimizer_are_refused_not_read_as_values(edit, kind, tmp_path):
    """In cpu mode with int8 state optimizer.state[p]["exp_avg"] holds codes: torch's way to reset a momentum,
    zero_() (or a new zero tensor), set every code to 0, which stands for about -1 x the block's scale, and the next
    step silently went on from that. The step now refuses it, before anything changes, saying what to do."""
    params = make_params()
    opt = make_opt(kind, params, "cpu", "int8", tmp_path)
    for step in range(2):
        for p, g in zip(params, grads(step, params)):
            p.grad = g
        opt.step()
    p = params[1]
    if edit == "zero_":
        opt.state[p]["exp_avg"].zero_()
    else:
        opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
    before = [q.detach().clone() for q in params]
    for q, g in zip(params, grads(2, params)):
        q.grad = g
    with pytest.raises(RuntimeError, match=r"'exp_avg'.*codes.*del opt.state\[p\]"):
        opt.step()
    assert all(torch.equal(q.detach(), b) for q, b in zip(params, before))
    del opt.state[p]  # what the message says: that parameter starts afresh, the others go on
    opt.step()
    assert float(opt.state[p]["step"]) == 1.0 and float(opt.state[params[0]]["step"]) == 3.0
    opt.load_state_dict(opt.state_dict())  # new code tensors from a load are the optimizer's own
    opt.step()
    opt.close()
