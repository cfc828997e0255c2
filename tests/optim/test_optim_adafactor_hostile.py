"""OffloadAdafactor as a hostile user drives it: Ctrl-C inside step(), odd shapes and layouts, every torch
argument, lifecycle corners; each against torch.optim.Adafactor or an uninterrupted run."""

import pytest
import torch

import swapio
import swapio.optim as so
from swapio import ops
from helpers.ctrl_c import ctrl_c_on_call, ctrl_c_on_swap_io
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

SHAPES = [(3000,), (17, 33), (70, 1000), (513,), (2, 3, 5), ()]  # 70 x 1000: its own 64 KiB+ nvme record


def make_params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in SHAPES]


def make_opt(params, mode, swap_dir):
    extra = {"swap_dir": swap_dir, **SMALL_BUFFERS} if mode == "nvme" else {}
    return so.OffloadAdafactor(params, offload=mode, lr=1e-2, weight_decay=0.05, **extra)


def set_grads(params, step, only=None):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = grad if only is None or i in only else None


def train(opt, params, first, last):
    for step in range(first, last + 1):
        set_grads(params, step)
        opt.step()


def snapshot(opt, params):
    sd = opt.state_dict()
    return [p.detach().clone() for p in params], {k: {n: t.clone() for n, t in st.items()}
                                                   for k, st in sd["state"].items()}


CASES = [("cpu", "kernel", 0), ("cpu", "kernel", 3), ("nvme", "kernel", 0), ("nvme", "kernel", 2),
         ("nvme", "pread", 1), ("nvme", "pwrite", 0), ("nvme", "pwrite", 2)]


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("mode, point, at", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ctrl_c_in_step_leaves_each_parameter_stepped_or_untouched(mode, point, at, dtype, tmp_path, monkeypatch):
    params = make_params(dtype=dtype)
    opt = make_opt(params, mode, tmp_path)
    train(opt, params, 1, 2)
    before = snapshot(opt, params)
    if point == "kernel":
        ctrl_c_on_call(monkeypatch, ops, "adafactor_step_", at)
    else:
        ctrl_c_on_swap_io(opt, monkeypatch, point, at)
    set_grads(params, 3)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    ref_params = make_params(dtype=dtype)
    ref = make_opt(ref_params, "cpu", tmp_path)
    train(ref, ref_params, 1, 3)
    stepped, now = snapshot(ref, ref_params), snapshot(opt, params)
    untouched = []
    for i in range(len(params)):
        count = now[1][i]["step"].item()
        expected = {2.0: before, 3.0: stepped}.get(count)
        assert expected is not None, f"parameter {i} has step {count}"
        assert torch.equal(now[0][i], expected[0][i]), (i, count)
        for name, t in now[1][i].items():
            assert torch.equal(t, expected[1][i][name]), (i, count, name)
        if count == 2.0:
            untouched.append(i)
    assert untouched, "Ctrl-C took effect before the end of the step"
    set_grads(params, 3, only=untouched)
    opt.step()
    train(opt, params, 4, 5)
    train(ref, ref_params, 4, 5)
    a, b = snapshot(opt, params), snapshot(ref, ref_params)
    for p, q in zip(a[0], b[0]):
        assert torch.equal(p, q)
    for k in a[1]:
        for n in a[1][k]:
            assert torch.equal(a[1][k][n], b[1][k][n]), (k, n)
    opt.close()
    ref.close()


@pytest.mark.parametrize("cls, key, value", [(so.OffloadAdafactor, "eps", {1e-30, 1e-3}),
                                             (so.OffloadAdafactor, "eps", {None: 0, 1e-3: 0}),
                                             (so.OffloadAdamW, "betas", {0.9, 0.999}),
                                             (so.OffloadLion, "betas", {0.9, 0.99})])
def test_an_unordered_pair_is_refused_as_by_torch(cls, key, value):
    """A set or dict has no order: eps={1e-30, 1e-3} iterated as (1e-3, 1e-30), eps1 and eps2 silently swapped.
    torch indexes the pair and refuses it; so do we (TypeError), in the constructor and in add_param_group."""
    torch_cls = getattr(torch.optim, cls.__name__[len("Offload"):], None)  # (torch has no Lion)
    if torch_cls is not None:
        with pytest.raises((TypeError, KeyError)):  # torch: value[0] of a set, of a dict
            torch_cls([torch.zeros(3, requires_grad=True)], **{key: value})
    with pytest.raises(TypeError, match=f"{key} must be an ordered pair"):
        cls([torch.zeros(3, requires_grad=True)], **{key: value})
    opt = cls([torch.zeros(3, requires_grad=True)])
    with pytest.raises(TypeError, match=f"{key} must be an ordered pair"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], key: value})
    opt.close()


@pytest.mark.parametrize("other", [so.OffloadAdamW, so.OffloadLion])
def test_checkpoint_of_another_optimizer_names_its_saver(other, tmp_path):
    """An AdamW checkpoint fails Adafactor's group checks first (eps 1e-8 is not a pair): the message names the
    optimizer that saved it, as a mismatch of the state's fields does, not only the eps it tripped on."""
    params = make_params()
    with other(params) as saver:
        set_grads(params, 1)
        saver.step()
        saver.save(tmp_path / "ckpt")
    with so.OffloadAdafactor(params) as opt:
        with pytest.raises(ValueError, match=f"saved by {other.__name__}; this optimizer is OffloadAdafactor"):
            opt.load(tmp_path / "ckpt")
        set_grads(params, 2)
        opt.step()  # left usable
    with so.OffloadAdafactor(params) as ada:
        set_grads(params, 1)
        ada.step()
        ada.save(tmp_path / "ada")
    with other(params) as opt:
        with pytest.raises(ValueError, match=f"saved by OffloadAdafactor; this optimizer is {other.__name__}"):
            opt.load(tmp_path / "ada")


def test_slots_larger_than_the_available_ram_are_refused_before_any_allocation(tmp_path, monkeypatch):
    # A whole-parameter rule sizes every nvme slot to the largest parameter's record: on a machine that cannot
    # hold buffer_count of them, the step must raise, not be killed by the OOM killer at its first touch.
    import swapio.optim.nvme_state as nvme_state
    p = torch.nn.Parameter(torch.randn(512, 512).bfloat16())  # its record: a 1 MiB fp32 master (+ factors)
    opt = swapio.optim.OffloadAdafactor([p], offload="nvme", swap_dir=tmp_path, buffer_bytes=256 << 10,
                                        buffer_count=4)
    monkeypatch.setattr(nvme_state, "_available_ram", lambda: 3 * 512 * 512 * 4)  # less than 4 slots' worth
    p.grad = torch.randn(512, 512).bfloat16()
    before = p.detach().clone()
    with pytest.raises(MemoryError, match="buffer_count"):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state.get(p)
    monkeypatch.undo()
    opt.step()  # with the memory there, the same optimizer goes on
    assert not torch.equal(p.detach(), before)
    opt.close()


def test_an_infinite_hyperparameter_is_refused_saying_it_must_be_finite():
    """eps1, eps2 or weight_decay infinite only make the parameters inf or NaN (in torch too): refused."""
    p = torch.nn.Parameter(torch.randn(3, 3))
    for kwargs in ({"eps": (None, float("inf"))}, {"eps": (float("inf"), 1e-3)}, {"weight_decay": float("inf")}):
        with pytest.raises(ValueError, match="and finite but is: inf"):
            so.OffloadAdafactor([p], **kwargs)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_infinite_d_and_lr_step_as_torch(offload, tmp_path):
    """torch takes d=inf (no update clipping) and lr=inf (the relative step 1/sqrt(t) uncapped), and its step is
    well defined with them; they were refused as if the kernel could not compute them. They step as torch's, in a
    param group, after add_param_group and through save()/load()."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(s, generator=gen).requires_grad_(True) for s in [(4, 6), (7,), (3, 5)]]
    refs = [p.detach().clone().requires_grad_(True) for p in ours]
    inf = float("inf")
    opt = so.OffloadAdafactor([{"params": ours[:2], "lr": inf}], d=inf, offload=offload, swap_dir=tmp_path / "a")
    ref = torch.optim.Adafactor([{"params": refs[:2], "lr": inf}], d=inf)
    opt.add_param_group({"params": ours[2:], "d": inf, "lr": 0.05})
    ref.add_param_group({"params": refs[2:], "d": inf, "lr": 0.05})
    for step in range(6):
        if step == 3:
            opt.save(tmp_path / "ckpt")
            resumed = so.OffloadAdafactor([{"params": ours[:2]}, {"params": ours[2:]}], offload=offload,
                                          swap_dir=tmp_path / "b")
            resumed.load(tmp_path / "ckpt")
            assert resumed.param_groups[0]["lr"] == inf and resumed.param_groups[1]["d"] == inf
            opt.close()
            opt = resumed
        for p, r in zip(ours, refs):
            p.grad = torch.randn(p.shape, generator=gen) * 50
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, r in zip(ours, refs):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-5)
    opt.close()


def test_transformers_adafactor_arguments_are_named_as_not_offered():
    p = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.raises(TypeError, match=r"transformers.Adafactor's \['relative_step', 'scale_parameter'\]"):
        so.OffloadAdafactor([p], lr=None, relative_step=True, scale_parameter=True)


@pytest.mark.parametrize("key, value, equivalent", [
    ("relative_step", True, r"relative_step: .*lr=1e-2"), ("scale_parameter", False, r"scale_parameter: .*RMS"),
    ("warmup_init", True, r"warmup_init: lr=1e-6 with .*LambdaLR"), ("clip_threshold", 1.0, r"clip_threshold: d"),
    ("decay_rate", -0.8, r"decay_rate: beta2_decay"), ("beta1", None, r"beta1: .*no first moment")])
def test_a_transformers_adafactor_argument_is_refused_naming_its_torch_equivalent(key, value, equivalent):
    """transformers.Adafactor's arguments, given to the constructor or in a param group (the constructor's list
    or add_param_group; torch keeps unknown group keys, so they would be silently ignored): a TypeError naming
    each with its nearest torch.optim.Adafactor setting, and no group added."""
    p, q = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(TypeError, match=f"transformers.Adafactor's \\['{key}'\\].*{equivalent}"):
        so.OffloadAdafactor([p], **{key: value})
    with pytest.raises(TypeError, match=f"transformers.Adafactor's \\['{key}'\\].*{equivalent}"):
        so.OffloadAdafactor([{"params": [p], key: value}])
    opt = so.OffloadAdafactor([p])
    with pytest.raises(TypeError, match=f"transformers.Adafactor's \\['{key}'\\].*{equivalent}"):
        opt.add_param_group({"params": [q], key: value})
    assert len(opt.param_groups) == 1
    opt.close()


def test_lr_none_is_refused_naming_torchs_relative_step():
    """lr=None is transformers.Adafactor's default (its relative step); torch's lr is a number, the cap of the
    relative step min(lr, 1/sqrt(t)): the message says which number gives transformers' default."""
    p = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.raises(TypeError, match=r"lr=None .*relative step.*lr=1e-2"):
        so.OffloadAdafactor([p], lr=None)
    opt = so.OffloadAdafactor([p])
    with pytest.raises(TypeError, match=r"lr=None .*relative step.*lr=1e-2"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": None})
    opt.close()


@pytest.mark.parametrize("warmup_init", [False, True])
def test_the_named_equivalent_of_transformers_relative_step_matches_transformers(warmup_init):
    """What the refusal above says, checked against transformers.Adafactor itself: its default relative step (and
    warmup_init) is OffloadAdafactor with lr=1e-2 (lr=1e-6 under LambdaLR(opt, lambda e: e + 1)); the eps1 rules
    differ (transformers adds eps1 to g^2, torch clamps), which random gradients do not meet."""
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in [(5,), (6, 8)]]
    theirs, ours = ([t.clone().requires_grad_(True) for t in start] for _ in range(2))
    hf = transformers.optimization.Adafactor(theirs, lr=None, relative_step=True, scale_parameter=True,
                                             warmup_init=warmup_init)
    opt = so.OffloadAdafactor(ours, lr=1e-6 if warmup_init else 1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: e + 1) if warmup_init else None
    for _ in range(20):
        for a, b in zip(theirs, ours):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        hf.step()
        opt.step()
        if sched is not None:
            sched.step()
    for a, b, s in zip(theirs, ours, start):
        assert (a.detach() - b.detach()).abs().max() <= 1e-4 * (a.detach() - s).abs().max()
    opt.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("old, new, error, message", [
    ((24,), (4, 6), RuntimeError, r"number of dimensions.*give the optimizer a new parameter"),
    ((4, 6), (24,), ValueError, r"no longer fits its state, which holds row_var.*give the optimizer a new parameter")])
def test_a_parameter_whose_number_of_dimensions_changed_is_refused_naming_that(offload, old, new, error, message,
                                                                               tmp_path):
    """p.data replaced by a tensor of another number of dimensions after the first step: a vector keeps `variance`,
    a matrix its factors, so its state no longer fits (torch.optim.Adafactor fails too). Refused before anything
    changes, by a message that names the dimensions, not only Adam's amsgrad."""
    p = torch.nn.Parameter(torch.randn(old))
    opt = so.OffloadAdafactor([p], offload=offload, swap_dir=tmp_path)
    p.grad = torch.randn(old)
    opt.step()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    p.data, p.grad = torch.randn(new), torch.randn(new)
    value = p.detach().clone()
    with pytest.raises(error, match=message):
        opt.step()
    assert torch.equal(p.detach(), value)
    assert float(opt.state[p]["step"]) == 1.0
    p.data = torch.randn(old)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in before.items())
    opt.close()


def test_a_transformers_adafactor_state_dict_is_refused_saying_whose_it_is():
    """A transformers.Adafactor user switching mid-run: its state dict (exp_avg_sq_row/_col with eps1 added, RMS)
    is not torch's. Refused naming transformers.Adafactor, not only the torch keys its groups lack; the optimizer
    is left as it was."""
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn(p.shape)
    # what transformers.Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False).state_dict() holds
    # after a step (written out: importing transformers takes seconds)
    hf_state_dict = {
        "state": {0: {"step": 1, "exp_avg_sq_row": torch.rand(3), "exp_avg_sq_col": torch.rand(4),
                      "RMS": torch.tensor(1.0)},
                  1: {"step": 1, "exp_avg_sq": torch.rand(5), "RMS": torch.tensor(1.0)}},
        "param_groups": [{"lr": 1e-3, "eps": (1e-30, 1e-3), "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": None,
                          "weight_decay": 0.0, "scale_parameter": False, "relative_step": False,
                          "warmup_init": False, "params": [0, 1]}]}
    with so.OffloadAdafactor(params) as opt:
        opt.step()
        before = opt.state_dict()
        with pytest.raises(ValueError, match=r"param group 0: a state dict of transformers.Adafactor .*not "
                                             r"torch.optim.Adafactor's"):
            opt.load_state_dict(hf_state_dict)
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        assert all(torch.equal(after["state"][0][k], before["state"][0][k]) for k in before["state"][0])


def test_a_group_of_transformers_keys_beside_torchs_is_refused_at_load(tmp_path, monkeypatch):
    """What the development code before the refusal of transformers.Adafactor's group keys wrote for a group given
    them: torch's keys and theirs, kept unread. Never released (0.1.0 has no OffloadAdafactor), so refused at load,
    state dict or save() directory, naming the keys, the optimizer left as it was (docs/optim.md, "Adafactor").
    The state dict with the keys dropped loads and steps as torch.optim.Adafactor does from the same state dict."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    with so.OffloadAdafactor(params) as writer:
        for p in params:
            p.grad = torch.randn(p.shape)
        writer.step()
        writer.param_groups[0].update(relative_step=False, scale_parameter=False)  # what that code kept
        old = writer.state_dict()
        # that code's save() wrote such a group; today's refuses it (checks the groups as load() does)
        monkeypatch.setattr("swapio.optim.checkpoint.writer.check_groups", lambda *args: None)
        writer.save(tmp_path / "old")
    assert old["param_groups"][0]["relative_step"] is False
    with so.OffloadAdafactor(params) as opt:
        for load, source in ((opt.load_state_dict, old), (opt.load, tmp_path / "old")):
            with pytest.raises(ValueError, match=r"param group 0: .*\['relative_step', 'scale_parameter'\] have no "
                                                 r"place in it"):
                load(source)
            assert opt.state_dict()["state"] == {}
        for group in old["param_groups"]:
            group.pop("relative_step")
            group.pop("scale_parameter")
        reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
        torch_opt = torch.optim.Adafactor(reference)
        torch_opt.load_state_dict(old)
        opt.load_state_dict(old)
        grads = [torch.randn(p.shape) for p in params]
        for p, q, g in zip(params, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
        for p, q in zip(params, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
