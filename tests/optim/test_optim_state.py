"""OffloadAdamW state: state_dict format and round trips, cross-loading with torch, bit-identical resume,
streaming checkpoints, and the Optimizer protocol (closure, zero_grad, skipped and sparse grads, bad arguments,
swap directory lifetime)."""
import gc
import io
import json
import os
import stat

import pytest
import torch

import swapio.optim as so
from swapio.optim import checkpoint
from helpers.optim import SMALL_BUFFERS, TOL, feed, masters, one_thread, ref_copy, rel_diff  # noqa: F401

MODES = ["cpu", "nvme"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SHAPES = [(3000,), (17, 33), (5,), (12001,)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in SHAPES]


def _grads(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(n)]


def _opt(params, mode, tmp_path, cls=so.OffloadAdamW, **kwargs):
    extra = {"swap_dir": tmp_path, **SMALL_BUFFERS} if mode == "nvme" else {}
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3, "weight_decay": 0.0}]
    return cls(groups, lr=1e-2, weight_decay=0.1, offload=mode, **extra, **kwargs)


def _apply(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.dtype)
    opt.step()


def _assert_state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for name, t in a["state"][k].items():
            assert t.dtype == b["state"][k][name].dtype
            assert torch.equal(t, b["state"][k][name]), (k, name)


def _snapshot(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- format and round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_state_dict_has_torch_format_with_fp32_state(mode, dtype, tmp_path):
    params = _params(dtype)
    opt = _opt(params, mode, tmp_path)
    for grads in _grads(3):
        _apply(opt, params, grads)
    sd = opt.state_dict()
    ref_keys = set(torch.optim.AdamW([torch.zeros(1)]).state_dict()["param_groups"][0])
    for group in sd["param_groups"]:
        assert {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "params"} <= set(group) <= ref_keys
        assert group["decoupled_weight_decay"] is True
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]
    for i, p in enumerate(params):
        st = sd["state"][i]
        expected = {"step", "exp_avg", "exp_avg_sq"} | ({"master"} if dtype != torch.float32 else set())
        assert set(st) == expected
        assert st["step"].dtype == torch.float32 and st["step"].shape == () and st["step"].item() == 3
        for name in expected - {"step"}:
            assert st[name].dtype == torch.float32 and st[name].shape == p.shape and st[name].device.type == "cpu"
    opt.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trip(mode, dtype, tmp_path):
    params = _params(dtype)
    a = _opt(params, mode, tmp_path)
    for grads in _grads(4):
        _apply(a, params, grads)
    sd = _snapshot(a.state_dict())
    b = _opt(params, mode, tmp_path)
    b.load_state_dict(sd)
    _assert_state_equal(b.state_dict(), sd)
    a.close()
    b.close()


@pytest.mark.parametrize("mode", MODES)
def test_torch_adamw_checkpoint_loads_and_continues(mode, tmp_path):
    ref = _params()
    torch_opt = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "lr": 5e-3, "weight_decay": 0.0}],
                                  lr=1e-2, weight_decay=0.1, foreach=False)
    grads = _grads(10)
    for g in grads[:5]:
        _apply(torch_opt, ref, g)
    ours_params = [p.detach().clone().requires_grad_(True) for p in ref]
    ours = _opt(ours_params, mode, tmp_path)
    ours.load_state_dict(_snapshot(torch_opt.state_dict()))
    for g in grads[5:]:
        _apply(torch_opt, ref, g)
        _apply(ours, ours_params, g)
    for mine, theirs in zip(ours_params, ref):
        assert rel_diff(mine, theirs) <= TOL
    sd = ours.state_dict()
    for i, q in enumerate(ref):
        assert sd["state"][i]["step"].item() == 10
        assert rel_diff(sd["state"][i]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"]) <= TOL
    ours.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_our_checkpoint_loads_into_torch_adamw_and_continues(mode, dtype, tmp_path):
    params = _params(dtype)
    ours = _opt(params, mode, tmp_path)
    grads = _grads(10)
    for g in grads[:5]:
        _apply(ours, params, g)
    ref = ref_copy(masters(ours, params))  # torch runs on our fp32 masters
    torch_opt = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:]}], foreach=False)
    torch_opt.load_state_dict(_snapshot(ours.state_dict()))
    assert all(g["decoupled_weight_decay"] for g in torch_opt.param_groups)
    assert [g["lr"] for g in torch_opt.param_groups] == [1e-2, 5e-3]
    for g in grads[5:]:
        _apply(ours, params, g)
        feed(ref, ref, [p.grad for p in params])
        torch_opt.step()
    for mine, theirs in zip(masters(ours, params), ref):
        assert rel_diff(mine, theirs) <= TOL
    ours.close()


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_keeps_fp32_moments_for_bf16_params(mode, tmp_path):
    ref = _params()
    torch_opt = torch.optim.AdamW(ref, foreach=False)
    for g in _grads(2):
        _apply(torch_opt, ref, g)
    sd = torch_opt.state_dict()
    params = [p.detach().bfloat16().requires_grad_(True) for p in ref]
    ours = so.OffloadAdamW(params, offload=mode, swap_dir=tmp_path)
    ours.load_state_dict(sd)
    mine = ours.state_dict()
    for i, q in enumerate(ref):
        for name in ("exp_avg", "exp_avg_sq"):
            assert mine["state"][i][name].dtype == torch.float32
            assert torch.equal(mine["state"][i][name], torch_opt.state[q][name])  # not rounded through bf16
        assert torch.equal(mine["state"][i]["master"], params[i].detach().float())  # no master: the param's value
    ours.close()


def test_load_state_dict_rejects_mismatched_groups_and_sizes(tmp_path):
    params = _params()
    opt = so.OffloadAdamW(params)
    for g in _grads(1):
        _apply(opt, params, g)
    sd = opt.state_dict()
    other = so.OffloadAdamW(params[:3])
    with pytest.raises(ValueError, match="doesn't match the size"):
        other.load_state_dict(sd)
    bad = _snapshot(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match="elements"):
        so.OffloadAdamW(params).load_state_dict(bad)


@pytest.mark.parametrize("mode", MODES)
def test_torch_state_dict_hooks_see_the_full_fp32_state(mode, tmp_path):
    params = _params(torch.bfloat16)
    opt = _opt(params, mode, tmp_path)
    _apply(opt, params, _grads(1)[0])
    exported = []
    opt.register_state_dict_post_hook(lambda o, sd: exported.append({k: sorted(v) for k, v in sd["state"].items()}))
    sd = _snapshot(opt.state_dict())
    assert exported == [{k: ["exp_avg", "exp_avg_sq", "master", "step"] for k in range(len(params))}]
    installed = []
    opt.register_load_state_dict_post_hook(lambda o: installed.append(_snapshot(o.state_dict())))
    sd["state"][0]["exp_avg"].add_(1.0)  # not representable in bf16 at these magnitudes: must stay fp32
    opt.load_state_dict(sd)
    assert len(installed) == 1
    _assert_state_equal(installed[0], sd)
    opt.close()


def test_rejected_state_dict_leaves_the_optimizer_as_it_was(tmp_path):
    params = _params()
    opt = so.OffloadAdamW(params)
    _apply(opt, params, _grads(1)[0])
    before = _snapshot(opt.state_dict())
    bad = _snapshot(before)
    bad["param_groups"][0]["lr"] = 0.5
    bad["state"][3]["exp_avg_sq"] = torch.zeros(7)
    with pytest.raises(ValueError, match="elements"):
        opt.load_state_dict(bad)
    _assert_state_equal(opt.state_dict(), before)


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_failing_to_install_leaves_the_optimizer_as_it_was(mode, tmp_path, monkeypatch):
    params = _params()
    opt = _opt(params, mode, tmp_path)
    _apply(opt, params, _grads(1)[0])
    before = _snapshot(opt.state_dict())
    other = _snapshot(before)
    other["param_groups"][0]["lr"] = 0.5
    backend = type(opt._backend)

    def failing_fill(self, entries, source, *args):
        raise OSError(5, "injected install failure")

    monkeypatch.setattr(backend, "fill", failing_fill)
    with pytest.raises(OSError, match="injected"):
        opt.load_state_dict(other)
    monkeypatch.undo()
    _assert_state_equal(opt.state_dict(), before)
    opt.close()


# ---- resume ---------------------------------------------------------------------------------------------------
def _run_and_resume(dtype, save_mode, load_mode, tmp_path, via):
    grads = _grads(10, seed=7)
    params = _params(dtype)
    a = _opt(params, save_mode, tmp_path)
    for g in grads[:5]:
        _apply(a, params, g)
    saved_params = [p.detach().clone() for p in params]
    if via == "state_dict":
        ckpt = _snapshot(a.state_dict())
    else:
        ckpt = tmp_path / "ckpt"
        a.save(ckpt)
    for g in grads[5:]:
        _apply(a, params, g)
    resumed = [p.clone().requires_grad_(True) for p in saved_params]
    b = _opt(resumed, load_mode, tmp_path)
    if via == "state_dict":
        b.load_state_dict(ckpt)
    else:
        b.load(ckpt)
    for g in grads[5:]:
        _apply(b, resumed, g)
    for p, q in zip(params, resumed):
        assert torch.equal(p.detach(), q.detach())
    _assert_state_equal(a.state_dict(), b.state_dict())
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_resume_from_state_dict_is_bit_identical(mode, dtype, tmp_path):
    _run_and_resume(dtype, mode, mode, tmp_path, "state_dict")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("save_mode,load_mode", [("cpu", "cpu"), ("nvme", "nvme"), ("nvme", "cpu"), ("cpu", "nvme")])
def test_resume_from_checkpoint_dir_is_bit_identical(save_mode, load_mode, dtype, tmp_path):
    _run_and_resume(dtype, save_mode, load_mode, tmp_path, "save")


# ---- streaming checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_save_writes_one_safetensors_file(mode, tmp_path):
    params = _params(torch.bfloat16)
    opt = _opt(params, mode, tmp_path)
    ckpt = tmp_path / "ckpt"
    for g in _grads(2):
        _apply(opt, params, g)
        opt.save(ckpt)  # the second save replaces the first
    assert os.listdir(ckpt) == [checkpoint.FILE]
    meta = checkpoint.read_meta(ckpt)
    assert meta["format"] == checkpoint.FORMAT and meta["optimizer"] == "OffloadAdamW"
    assert set(meta["state"][0]["fields"]) == {"exp_avg", "exp_avg_sq", "master"}
    assert os.path.getsize(ckpt / meta["data"]) == meta["data_bytes"]
    opt.close()


@pytest.mark.parametrize("mode", MODES)
def test_failed_save_leaves_previous_checkpoint(mode, tmp_path, monkeypatch):
    params = _params()
    opt = _opt(params, mode, tmp_path)
    ckpt = tmp_path / "ckpt"
    _apply(opt, params, _grads(1)[0])
    opt.save(ckpt)
    before = sorted(os.listdir(ckpt))
    _apply(opt, params, _grads(1, seed=3)[0])

    def crash(*args):
        raise OSError("simulated crash before the commit")

    monkeypatch.setattr(checkpoint.os, "rename", crash)  # the commit's rename
    with pytest.raises(OSError, match="simulated"):
        opt.save(ckpt)
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt)) == before  # no temporary left behind
    other = _opt([p.detach().clone().requires_grad_(True) for p in params], mode, tmp_path)
    other.load(ckpt)
    assert all(st["step"].item() == 1 for st in other.state_dict()["state"].values())
    opt.close()
    other.close()


def test_load_rejects_missing_or_truncated_checkpoint(tmp_path):
    params = _params()
    opt = so.OffloadAdamW(params)
    with pytest.raises(FileNotFoundError):
        opt.load(tmp_path / "nothing")
    _apply(opt, params, _grads(1)[0])
    opt.save(tmp_path / "ckpt")
    meta = checkpoint.read_meta(tmp_path / "ckpt")
    os.truncate(tmp_path / "ckpt" / meta["data"], meta["data_bytes"] - 1)
    with pytest.raises(ValueError, match="truncated"):
        opt.load(tmp_path / "ckpt")


# ---- the Optimizer protocol -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_closure_is_evaluated_with_grad_and_its_loss_returned(mode, tmp_path):
    w = torch.ones(4, requires_grad=True)
    opt = so.OffloadAdamW([w], lr=0.1, offload=mode, swap_dir=tmp_path)

    def closure():
        opt.zero_grad()
        assert torch.is_grad_enabled()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 4.0
    assert torch.all(w.detach() < 1.0)
    opt.close()


def test_zero_grad_sets_grads_to_none_or_zero():
    w = torch.ones(4, requires_grad=True)
    opt = so.OffloadAdamW([w])
    w.grad = torch.ones(4)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(w.grad, torch.zeros(4))
    opt.zero_grad()
    assert w.grad is None


@pytest.mark.parametrize("mode", MODES)
def test_params_without_grad_are_skipped(mode, tmp_path):
    params = _params()
    opt = _opt(params, mode, tmp_path)
    before = params[1].detach().clone()
    grads = _grads(3)
    for g in grads:
        _apply(opt, params, [g[0], None, g[2], g[3]])
    assert torch.equal(params[1].detach(), before)
    sd = opt.state_dict()
    assert 1 not in sd["state"] and sd["state"][0]["step"].item() == 3
    _apply(opt, params, grads[0])  # first grad for params[1]: its state starts now
    assert opt.state_dict()["state"][1]["step"].item() == 1
    opt.close()


@pytest.mark.parametrize("mode", MODES)
def test_sparse_grad_is_rejected_before_any_update(mode, tmp_path):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.ones(3, requires_grad=True)
    opt = so.OffloadAdamW([dense, emb.weight], offload=mode, swap_dir=tmp_path)
    dense.grad = torch.ones(3)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(3)) and not opt.state_dict()["state"]
    opt.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": -1e-3}, "Invalid learning rate"),
    ({"eps": -1.0}, "Invalid epsilon"),
    ({"betas": (1.0, 0.999)}, "index 0"),
    ({"betas": (0.9, -0.1)}, "index 1"),
    ({"betas": 0.9}, "pair"),
    ({"weight_decay": -0.1}, "Invalid weight_decay"),
    ({"offload": "gpu"}, "offload"),
    ({"offload": "nvme"}, "swap_dir"),
    ({"buffer_count": 2}, "buffer_count"),
    ({"buffer_bytes": 4096}, "64 KiB"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        so.OffloadAdamW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_unsupported_params_and_arguments():
    with pytest.raises(ValueError, match="float64"):
        so.OffloadAdam([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(ValueError, match="complex"):
        so.OffloadAdam([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])
    with pytest.raises(TypeError, match="fused"):
        so.OffloadAdamW([torch.zeros(3, requires_grad=True)], fused=True)
    opt = so.OffloadAdamW([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match="float64"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.float64, requires_grad=True)]})
    assert len(opt.param_groups) == 1


def test_adam_keeps_l2_decay_and_adamw_forces_decoupled():
    p = [torch.zeros(3, requires_grad=True)]
    assert so.OffloadAdam(p).param_groups[0]["decoupled_weight_decay"] is False
    assert so.OffloadAdam(p, decoupled_weight_decay=True).param_groups[0]["decoupled_weight_decay"] is True
    adamw = so.OffloadAdamW(p)
    adamw.load_state_dict(torch.optim.Adam(p).state_dict())  # torch's AdamW does the same
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True
    assert adamw.param_groups[0]["weight_decay"] == 0


@pytest.mark.parametrize("value", [False, True])
def test_adamw_given_decoupled_weight_decay_says_it_takes_none(value):
    """torch's AdamW takes no decoupled_weight_decay (TypeError); ours said OffloadAdam.__init__ got it twice."""
    with pytest.raises(TypeError, match=r"OffloadAdamW .*decoupled_weight_decay.*OffloadAdam\(decoupled_weight_decay"):
        so.OffloadAdamW([torch.zeros(3, requires_grad=True)], decoupled_weight_decay=value)


# ---- swap directory and I/O settings --------------------------------------------------------------------------
def test_swap_dir_is_private_and_removed_on_close(tmp_path):
    params = _params()
    opt = _opt(params, "nvme", tmp_path)
    _apply(opt, params, _grads(1)[0])
    d = opt.swap_path
    assert os.path.dirname(d) == str(tmp_path)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.listdir(d)
    opt.close()
    assert not os.path.exists(d)
    opt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


def test_swap_dir_removed_when_optimizer_is_collected(tmp_path):
    params = _params()
    opt = _opt(params, "nvme", tmp_path)
    _apply(opt, params, _grads(1)[0])
    d = opt.swap_path
    with so.OffloadAdamW(params, offload="nvme", swap_dir=tmp_path) as ctx:
        d2 = ctx.swap_path
    assert not os.path.exists(d2)
    del opt
    gc.collect()
    assert not os.path.exists(d)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cls", [so.OffloadAdamW, so.OffloadLion], ids=["adamw", "lion"])
def test_a_swap_dir_that_does_not_exist_yet_is_made(tmp_path, cls):
    """As DeepSpeed makes its swap folders: the missing directories are made, and the optimizer steps as torch's
    (or as one on an existing swap_dir) would."""
    swap_dir = tmp_path / "not" / "yet"
    params, ref = _params(), _params()
    opt = _opt(params, "nvme", swap_dir, cls=cls)
    want = _opt(ref, "cpu", tmp_path, cls=cls)
    for grads in _grads(2):
        _apply(opt, params, grads)
        _apply(want, ref, grads)
    assert os.path.dirname(opt.swap_path) == str(swap_dir) and os.listdir(opt.swap_path)
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    opt.close()
    assert os.listdir(swap_dir) == []  # the private directory goes; the swap_dir the user named stays
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        _opt(_params(), "nvme", tmp_path / "file", cls=cls)


def test_a_swap_dir_given_as_bytes_works_as_a_str_one(tmp_path):
    """(os.PathLike and bytes paths are paths too: bytes failed with "Can't mix bytes and non-bytes".)"""
    params, ref = _params(), _params()
    opt = _opt(params, "nvme", os.fsencode(tmp_path / "b"))
    want = _opt(ref, "cpu", tmp_path)
    for grads in _grads(2):
        _apply(opt, params, grads)
        _apply(want, ref, grads)
    assert opt.swap_path.startswith(str(tmp_path / "b")) and all(torch.equal(a, b) for a, b in zip(params, ref))
    opt.close()


def test_io_config_file_and_kwargs_reach_the_handles(tmp_path):
    cfg = tmp_path / "tuned.json"
    cfg.write_text(json.dumps({"handle": {"block_size": 262144, "queue_depth": 8, "threads": 1,
                                          "engine": "psync"}}))
    opt = so.OffloadAdamW([torch.zeros(3, requires_grad=True)], offload="nvme", swap_dir=tmp_path,
                          io_config=cfg, queue_depth=4)
    h = opt._backend.rh
    assert (h.block_size, h.queue_depth, h.engine) == (262144, 4, "psync")
    opt.close()
    cfg.write_text(json.dumps({"handle": {"block_sz": 1}}))
    with pytest.raises(ValueError, match="unknown AioHandle config keys"):
        so.OffloadAdamW([torch.zeros(3, requires_grad=True)], offload="nvme", swap_dir=tmp_path, io_config=cfg)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["torch.optim.AdamW", "OffloadAdamW", "OffloadLion"])
def test_load_state_dict_refuses_state_shaped_for_another_parameter(source, mode, tmp_path):
    """Parameters given in another order (same element counts, other shapes): torch's step fails on the moments'
    shapes; reshaping them silently would scramble the moments (and a bf16 parameter's master) across elements."""
    a, b = torch.randn(4, 5).bfloat16().requires_grad_(True), torch.randn(5, 4).requires_grad_(True)
    if source.startswith("torch"):
        saved = torch.optim.AdamW([a, b])
    else:
        saved = getattr(so, source)([a, b], offload=mode, **({"swap_dir": tmp_path} if mode == "nvme" else {}))
    a.grad, b.grad = torch.randn(4, 5).bfloat16(), torch.randn(5, 4)
    saved.step()
    sd = _snapshot(saved.state_dict())
    cls = so.OffloadLion if source == "OffloadLion" else so.OffloadAdamW
    opt = _opt_like(cls, [b, a], mode, tmp_path)
    b.grad, a.grad = torch.randn(5, 4), torch.randn(4, 5).bfloat16()
    opt.step()
    before = _snapshot(opt.state_dict())
    with pytest.raises(ValueError, match=r"parameter 0: 'exp_avg' has shape \(4, 5\), but its parameter has shape "
                                         r"\(5, 4\)"):
        opt.load_state_dict(sd)
    _assert_state_equal(opt.state_dict(), before)
    opt.load_state_dict(_snapshot(before))  # its own state dict, in its own order, loads
    if hasattr(saved, "close"):
        saved.close()
    opt.close()


def _opt_like(cls, params, mode, tmp_path):
    return cls(params, offload=mode, **({"swap_dir": tmp_path / "other"} if mode == "nvme" else {}))


@pytest.mark.parametrize("cls", [so.OffloadAdamW, so.OffloadLion], ids=lambda c: c.__name__)
def test_nvme_state_entry_asked_for_a_moment_says_where_the_state_is(cls, tmp_path):
    """In nvme mode optimizer.state[p] holds only "step"; code that reads opt.state[p]["exp_avg"] (as with torch,
    or in cpu mode) got a bare KeyError. The KeyError now says where the moments are and how to read them; after
    a load too."""
    params = _params()
    opt = _opt(params, "nvme", tmp_path, cls=cls)
    _apply(opt, params, _grads(1)[0])
    p = params[0]

    def check():
        assert float(opt.state[p]["step"]) >= 1
        assert "exp_avg" not in opt.state[p] and opt.state[p].get("exp_avg") is None
        with pytest.raises(KeyError, match=r"exp_avg.*nvme.*swap file.*state_dict\(\)"):
            opt.state[p]["exp_avg"]

    check()
    opt.load_state_dict(_snapshot(opt.state_dict()))
    check()
    opt.save(tmp_path / "ckpt")
    opt.load(tmp_path / "ckpt")
    check()
    opt.close()


@pytest.mark.parametrize("mode", MODES)
def test_hooks_registered_by_the_user_see_the_whole_state_as_with_torch(mode, tmp_path):
    """The optimizer's own hooks fill in the state (state_dict), take it out of the state dict before torch casts it
    (load pre-hook) and install it (load post-hook). A user's load pre-hook that edits the state (resetting the
    momentum on resume) saw the state dict without the parameters' entries and was silently without effect; a
    user's post-hooks given prepend=True ran before ours and saw the state before it was filled in or installed."""
    params = _params(torch.bfloat16)
    opt = _opt(params, mode, tmp_path)
    _apply(opt, params, _grads(1)[0])
    sd = _snapshot(opt.state_dict())
    seen = {}

    def reset_momentum(o, state_dict):
        seen["load_pre"] = sorted(state_dict["state"])
        for st in state_dict["state"].values():
            st["exp_avg"] = torch.zeros_like(st["exp_avg"])

    opt.register_load_state_dict_pre_hook(reset_momentum)
    opt.register_state_dict_post_hook(
        lambda o, state_dict: seen.__setitem__("post", sorted(state_dict["state"][0])), prepend=True)
    opt.register_load_state_dict_post_hook(
        lambda o: seen.__setitem__("load_post", float(o.state[params[0]]["step"])), prepend=True)
    opt.load_state_dict(sd)
    assert seen["load_pre"] == list(range(len(params)))
    assert seen["load_post"] == 1.0
    after = opt.state_dict()
    assert seen["post"] == ["exp_avg", "exp_avg_sq", "master", "step"]
    for i in sd["state"]:
        assert not after["state"][i]["exp_avg"].any()
        assert torch.equal(after["state"][i]["exp_avg_sq"], sd["state"][i]["exp_avg_sq"])
    opt.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_load_out_into_the_state_dict_restores_the_state_or_refuses(mode, state_dtype, tmp_path):
    """swapio.checkpoint's way to resume a torch optimizer, load(path, out={"optimizer": opt.state_dict()}), fills
    the state dict's tensors in place. Where they are the live state (cpu mode, fp32 state, as torch's) that
    restores it; elsewhere they are copies, so the moments stayed as they were while the live step counts went
    back: the run went on from a state that was neither. That is now a ValueError before anything is read."""
    from swapio import checkpoint as ckpt
    params = _params(torch.bfloat16)
    opt = _opt(params, mode, tmp_path, state_dtype=state_dtype)
    grads = _grads(3)
    _apply(opt, params, grads[0])
    saved = _snapshot(opt.state_dict())
    ckpt.save({"optimizer": opt.state_dict()}, tmp_path / "c.safetensors")
    for g in grads[1:]:
        _apply(opt, params, g)
    before = _snapshot(opt.state_dict())
    out = {"optimizer": opt.state_dict()}
    if mode == "cpu" and state_dtype == "fp32":
        ckpt.load(tmp_path / "c.safetensors", out=out)
        _assert_state_equal(opt.state_dict(), saved)
    else:
        with pytest.raises(ValueError, match=r"copy .*OffloadAdamW.*load_state_dict"):
            ckpt.load(tmp_path / "c.safetensors", out=out)
        _assert_state_equal(opt.state_dict(), before)
        opt.load_state_dict(ckpt.load(tmp_path / "c.safetensors")["optimizer"])  # what the message says
        _assert_state_equal(opt.state_dict(), saved)
    opt.close()


def test_the_marks_on_exported_copies_go_with_them(tmp_path):
    from swapio.checkpoint import detached
    params = _params()
    opt = _opt(params, "nvme", tmp_path)
    _apply(opt, params, _grads(1)[0])
    held = len(detached._marked)
    for _ in range(20):
        sd = opt.state_dict()
        assert detached.message_of(sd["state"][0]["exp_avg"]) is not None
    del sd
    gc.collect()
    assert len(detached._marked) == held
    opt.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reset", ["assigned", "cleared"])
def test_resetting_the_state_restarts_every_parameter_as_torch(reset, mode, tmp_path):
    """`opt.state = collections.defaultdict(dict)`, a common way to reset an optimizer: the backend kept reading the
    old dict, so in cpu mode later steps used the moments from before the reset (and the new state was ignored)."""
    import collections
    params = _params()
    ref = ref_copy(params)
    ours = _opt(params, mode, tmp_path)
    theirs = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "lr": 5e-3, "weight_decay": 0.0}], lr=1e-2,
                               weight_decay=0.1, foreach=False)
    for k, grads in enumerate(_grads(4)):
        if k == 2:
            for opt in (ours, theirs):
                if reset == "assigned":
                    opt.state = collections.defaultdict(dict)
                else:
                    opt.state.clear()
        feed(params, ref, grads)
        ours.step()
        theirs.step()
    for mine, q in zip(masters(ours, params), ref):
        assert rel_diff(mine, q) <= TOL
    assert [float(ours.state[p]["step"]) for p in params] == [2.0] * len(params)
    ours.close()


@pytest.mark.parametrize("cls", [so.OffloadAdamW, so.OffloadAdam, so.OffloadLion, so.OffloadAdafactor],
                         ids=["adamw", "adam", "lion", "adafactor"])
def test_a_swap_dir_alone_puts_the_state_there(tmp_path, cls):
    """OffloadAdamW(params, swap_dir=...) without offload= kept the state in RAM and never used the directory the
    user named (the default was offload="cpu"). A swap_dir alone now means nvme mode; an explicit offload="cpu"
    still keeps the state in RAM (config-driven code passes both), and no swap_dir still means cpu mode."""
    alone = cls(_params(), swap_dir=tmp_path / "alone")
    assert alone.offload == "nvme" and os.listdir(alone.swap_path)
    assert os.path.dirname(alone.swap_path) == str(tmp_path / "alone")
    alone.close()
    explicit = cls(_params(), offload="cpu", swap_dir=tmp_path / "explicit")
    assert explicit.offload == "cpu" and not os.path.exists(tmp_path / "explicit")
    assert cls(_params()).offload == "cpu"
