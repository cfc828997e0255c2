"""An offloaded model trained by a swapio optimizer gives exactly the losses and weights of the same
model trained resident with the same optimizer and options (torch.equal, no tolerance)."""
import itertools
import os

import pytest
import torch

from swapio.offload import disk_offload, remove_offload
from swapio.optim import OffloadAdamW
from helpers.offload_training import (MLP, Tied, assert_same_losses, assert_same_weights, batches, build_opt,
                                      clipped_norms,
                                      make_model, offload, one_thread, resident_run,
                                      train, weights, loss_of)

pytest.importorskip("safetensors")

STATES = [("AdamW", "fp32"), ("AdamW", "bf16"), ("AdamW", "int8"), ("Lion", "fp32")]
STORAGES = ["disk", "ckpt", "cpu"]
MODES = ["accum1", "accum2", "inback"]  # one micro-batch per step; two; in_backward=True (one micro-batch)


def _matrix():
    """states x storages x modes (36 cases); weight dtype and offload mode rotate so that every pair of values
    of any two dimensions appears (combo = sum of the indices mod 4)."""
    out = []
    for (i, st), (j, sto), (k, mode) in itertools.product(enumerate(STATES), enumerate(STORAGES), enumerate(MODES)):
        combo = (i + j + k) % 4
        dtype = "bf16" if combo % 2 else "fp32"
        off = "nvme" if combo // 2 else "cpu"
        out.append(pytest.param(st[0], st[1], sto, mode, dtype, off,
                                id=f"{st[0]}-{st[1]}-{sto}-{mode}-{dtype}-{off}"))
    return out


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,state_dtype,storage,mode,wdtype,off", _matrix())
def test_offloaded_training_equals_resident(tmp_path, opt_name, state_dtype, storage, mode, wdtype, off):
    dtype = DTYPES[wdtype]
    micro = 2 if mode == "accum2" else 1
    data = batches(MLP, 3 * micro)
    kw = dict(offload=off, state_dtype=state_dtype, in_backward=mode == "inback")
    want_losses, want = resident_run(MLP, dtype, opt_name, data, tmp_path, micro, kw)

    model = offload(make_model(MLP, dtype), storage, tmp_path, MLP, dtype)
    assert all(p.device.type == "meta" for p in model.parameters())
    opt = build_opt(opt_name, model.parameters(), tmp_path, **kw)
    got_losses = train(model, opt, data, micro)
    assert_same_losses(got_losses, want_losses)
    # the forward after the last step reads the last step's weights
    with torch.no_grad(), one_thread():
        after = loss_of(model, data[0])
    remove_offload(model)
    assert_same_weights(weights(model), want)
    with torch.no_grad(), one_thread():
        assert torch.equal(loss_of(model, data[0]), after)
    opt.close()


@pytest.mark.parametrize("opt_name", ["Adam", "Lion"])
@pytest.mark.parametrize("in_backward", [False, True])
def test_other_rules_bf16_nvme(tmp_path, opt_name, in_backward):
    """OffloadAdam (L2 decay) and OffloadLion, bf16 weights, bf16 state, nvme, disk_offload."""
    kw = dict(offload="nvme", state_dtype="bf16", in_backward=in_backward)
    data = batches(MLP, 3)
    want_losses, want = resident_run(MLP, torch.bfloat16, opt_name, data, tmp_path, 1, kw)
    model = offload(make_model(MLP, torch.bfloat16), "disk", tmp_path)
    with build_opt(opt_name, model.parameters(), tmp_path, **kw) as opt:
        assert_same_losses(train(model, opt, data), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), want)


# ---- ties -----------------------------------------------------------------------------------------------------
def test_tied_weight_is_one_parameter(tmp_path):
    model = offload(make_model(Tied), "disk", tmp_path)
    params = list(model.parameters())
    assert len(params) == len(list(make_model(Tied).parameters())) == 3  # emb/head once, mid.weight, mid.bias
    assert len({id(p) for p in params}) == 3
    assert model.emb.weight is model.head.weight
    remove_offload(model)


@pytest.mark.parametrize("storage,off,in_backward", [("disk", "nvme", False), ("ckpt", "cpu", True),
                                                      ("cpu", "cpu", False), ("disk", "cpu", True)])
def test_tied_model_trains_like_resident(tmp_path, storage, off, in_backward):
    kw = dict(offload=off, in_backward=in_backward)
    data = batches(Tied, 3)
    want_losses, want = resident_run(Tied, torch.float32, "AdamW", data, tmp_path, 1, kw)
    model = offload(make_model(Tied), storage, tmp_path, Tied)
    with build_opt("AdamW", model.parameters(), tmp_path, **kw) as opt:
        assert len(opt.param_groups[0]["params"]) == 3
        assert_same_losses(train(model, opt, data), want_losses)
        assert len(opt.state) == 3
    remove_offload(model)
    assert model.emb.weight is model.head.weight
    assert_same_weights(weights(model), want)


def test_tied_gpt2_trains_like_resident(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)

    def build():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg)

    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 64, (2, 10), generator=g) for _ in range(3)]

    def run(model, opt):
        out = []
        with one_thread():
            for ids in data:
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.detach())
        return out

    ref = build()
    with build_opt("AdamW", ref.parameters(), tmp_path) as opt:
        want_losses = run(ref, opt)
    model = offload(build(), "disk", tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == len(list(build().parameters()))
    with build_opt("AdamW", model.parameters(), tmp_path, offload="nvme") as opt:
        got_losses = run(model, opt)
    assert_same_losses(got_losses, want_losses)
    remove_offload(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_same_weights(weights(model), weights(ref))


# ---- mixed: frozen offloaded, trainable offloaded, trainable resident -------------------------------------------
@pytest.mark.parametrize("off,in_backward", [("cpu", False), ("nvme", True), ("nvme", False)])
def test_mixed_frozen_trainable_resident(tmp_path, off, in_backward):
    def prepare(model):
        model.a.requires_grad_(False)  # frozen, offloaded
        return model

    data = batches(MLP, 3)
    kw = dict(offload=off, in_backward=in_backward)
    ref = prepare(make_model())
    with build_opt("AdamW", [p for p in ref.parameters() if p.requires_grad], tmp_path / "r", **kw) as opt:
        want_losses = train(ref, opt, data)

    model = prepare(make_model())
    frozen_before = {n: t.clone() for n, t in weights(make_model()).items() if n.startswith("a.")}
    model = offload(model, "disk", tmp_path, keep_resident=["c"])
    assert model.c.weight.device.type == "cpu" and model.b.weight.device.type == "meta"
    od_files = sorted(os.listdir(tmp_path / "od"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 6  # norm, b (offloaded), c (resident)
    with build_opt("AdamW", trainable, tmp_path, **kw) as opt:
        got_losses = train(model, opt, data)
        assert len([p for p, s in opt.state.items() if s]) == 6
        assert all(not opt.state.get(p) for p in (model.a.weight, model.a.bias))
    assert_same_losses(got_losses, want_losses)
    assert sorted(os.listdir(tmp_path / "od")) == od_files
    remove_offload(model)
    got = weights(model)
    assert_same_weights(got, weights(ref))
    for n, t in frozen_before.items():
        assert torch.equal(got[n], t)  # frozen: bytes unchanged


# ---- gradient accumulation --------------------------------------------------------------------------------
@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu"), ("ckpt", "nvme")])
def test_three_micro_batches_fp32(tmp_path, storage, off):
    data = batches(MLP, 6)
    kw = dict(offload=off)
    want_losses, want = resident_run(MLP, torch.float32, "AdamW", data, tmp_path, 3, kw)
    model = offload(make_model(), storage, tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path, **kw) as opt:
        assert_same_losses(train(model, opt, data, micro=3), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), want)


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_zero_grad_clears_accumulated_gradients(tmp_path, off):
    """A backward, zero_grad(), another backward, step(): only the second gradient counts."""
    data = batches(MLP, 2)
    ref = make_model()
    with build_opt("AdamW", ref.parameters(), tmp_path / "r", offload=off) as opt, one_thread():
        loss_of(ref, data[0]).backward()
        opt.zero_grad()
        loss_of(ref, data[1]).backward()
        opt.step()
    model = offload(make_model(), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path, offload=off) as opt, one_thread():
        loss_of(model, data[0]).backward()
        assert opt.memory_report()["grad_bytes"] > 0
        opt.zero_grad()
        loss_of(model, data[1]).backward()
        opt.step()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_step_twice_without_zero_grad_reuses_the_sum(tmp_path, off):
    """torch keeps .grad after step(): a second step() without zero_grad() uses the same summed gradient."""
    data = batches(MLP, 2)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    mine = make_model()
    opt_res = build_opt("AdamW", mine.parameters(), tmp_path / "r", offload=off)
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path, offload=off)
    with one_thread():
        for m, o in ((ref, ref_opt), (mine, opt_res), (model, opt)):
            for b in data:
                loss_of(m, b).backward()
            o.step()
            o.step()  # no zero_grad: the same gradients again
        # and after that, another backward adds to the kept sum
        for m, o in ((ref, ref_opt), (mine, opt_res), (model, opt)):
            loss_of(m, data[0]).backward()
            o.step()
    remove_offload(model)
    assert_same_weights(weights(model), weights(mine))
    for n, t in weights(ref).items():  # and torch's AdamW agrees to rounding
        assert torch.allclose(weights(model)[n], t, rtol=1e-5, atol=1e-6), n
    opt.close()
    opt_res.close()


def test_bf16_accumulation_sums_in_fp32(tmp_path):
    """Documents the design: two bf16 gradients are summed in fp32 (not in bf16 as torch's .grad would)."""
    data = batches(MLP, 2)
    want_losses, want = resident_run(MLP, torch.bfloat16, "AdamW", data, tmp_path, 2, {})
    model = offload(make_model(MLP, torch.bfloat16), "cpu", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path) as opt:
        assert_same_losses(train(model, opt, data, micro=2), want_losses)
    remove_offload(model)
    assert_same_weights(weights(model), want)


# ---- clip_grad_norm_ --------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage,off,max_norm,micro", [("disk", "nvme", 0.05, 2), ("disk", "nvme", 0.05, 1),
                                                         ("cpu", "cpu", 0.05, 1),
                                                         ("ckpt", "cpu", 100.0, 1), ("disk", "cpu", 0.05, 1)])
def test_clip_grad_norm_equals_torch(tmp_path, storage, off, max_norm, micro):
    data = batches(MLP, 3 * micro)
    keep = ["c"] if storage == "disk" else []  # with a resident module too: the norm covers both

    ref = make_model()
    with build_opt("AdamW", ref.parameters(), tmp_path / "r", offload=off) as opt:
        torch_clip = lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)  # noqa: E731
        want_norms = clipped_norms(ref, opt, data, torch_clip, micro)
    model = offload(make_model(), storage, tmp_path, keep_resident=keep)
    with build_opt("AdamW", model.parameters(), tmp_path, offload=off) as opt:
        got_norms = clipped_norms(model, opt, data, lambda m, o: o.clip_grad_norm_(max_norm), micro)
    for g, w in zip(got_norms, want_norms):
        assert torch.equal(g.reshape(()), w.reshape(())), (g, w)
    if max_norm < 1:
        assert all(w > max_norm for w in want_norms)  # clipping did happen
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


def test_clip_grad_norm_refused_in_backward_and_other_norms(tmp_path):
    model = offload(make_model(), "disk", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path, in_backward=True) as opt:
        with pytest.raises(RuntimeError, match="in_backward"):
            opt.clip_grad_norm_(1.0)
    with build_opt("AdamW", model.parameters(), tmp_path) as opt:
        loss_of(model, batches(MLP, 1)[0]).backward()
        with pytest.raises(ValueError, match="norm_type"):
            opt.clip_grad_norm_(1.0, norm_type=1.0)
        with pytest.raises(ValueError, match="norm_type"):
            opt.clip_grad_norm_(1.0, norm_type=float("inf"))
    remove_offload(model)


def test_clip_without_gradients_returns_zero(tmp_path):
    model = offload(make_model(), "cpu", tmp_path)
    with build_opt("AdamW", model.parameters(), tmp_path) as opt:
        assert float(opt.clip_grad_norm_(1.0)) == 0.0
    remove_offload(model)


# ---- memory_report ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_memory_report_grad_bytes(tmp_path, off):
    model = offload(make_model(), "disk", tmp_path)
    n = sum(p.numel() for p in model.parameters())
    with build_opt("AdamW", model.parameters(), tmp_path, offload=off) as opt:
        r = opt.memory_report()
        assert r["grad_bytes"] == 0 and r["params"] == 0
        with one_thread():
            loss_of(model, batches(MLP, 1)[0]).backward()
        r = opt.memory_report()
        assert r["grad_bytes"] >= 4 * n  # fp32 sums of every offloaded weight
        if off == "cpu":
            assert r["grad_bytes"] == 4 * n
        else:
            assert r["grad_bytes"] <= 4 * n + 4096 * len(list(model.parameters()))  # 4 KiB-aligned extents
        opt.step()
        r = opt.memory_report()
        assert r["params"] == n
        assert r["bytes_per_param"] == r["state_bytes"] / n
        opt.zero_grad()
        if off == "cpu":
            assert opt.memory_report()["grad_bytes"] == 0
    with build_opt("AdamW", model.parameters(), tmp_path, offload=off, in_backward=True) as opt:
        with one_thread():
            loss_of(model, batches(MLP, 1)[0]).backward()
        assert opt.memory_report()["grad_bytes"] == 0  # in backward: no gradient is stored
        opt.step()
    remove_offload(model)


def test_resident_model_dtype_preserved_after_remove(tmp_path):
    model = offload(make_model(MLP, torch.bfloat16), "ckpt", tmp_path, MLP, torch.bfloat16)
    with build_opt("AdamW", model.parameters(), tmp_path) as opt:
        train(model, opt, batches(MLP, 2))
    remove_offload(model)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["accumulate+clip", "in_backward"])
def test_llama_and_qwen2_style_models_train_exactly_like_resident(tmp_path, arch, in_backward):
    """The models people fine-tune (RMSNorm, RoPE, GQA, SwiGLU; Qwen2's attention biases), offloaded to disk with
    nvme state: losses and weights equal the resident run, with clipping or with in_backward."""
    import transformers
    transformers.logging.set_verbosity_error()
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=200)

    def make():
        torch.manual_seed(0)
        if arch == "llama":
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()

    ids = [torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def train_model(model, opt):
        losses = []
        with one_thread():
            for x in ids:
                loss = model(x, labels=x).loss
                loss.backward()
                if not in_backward:
                    opt.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return losses

    ref = make()
    want = train_model(ref, OffloadAdamW(ref.parameters(), lr=1e-2, in_backward=in_backward))
    model = disk_offload(make(), str(tmp_path / "od"))
    got = train_model(model, OffloadAdamW(model.parameters(), lr=1e-2, offload="nvme", swap_dir=str(tmp_path),
                                          in_backward=in_backward))
    remove_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
