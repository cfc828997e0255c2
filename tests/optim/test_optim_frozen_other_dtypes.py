"""Frozen parameters of dtypes swapio does not step (a bitsandbytes-style int8 base weight, a float64 buffer made a
parameter) in the list given to an optimizer, as `model.parameters()` hands them over: torch's optimizers take them
and never step them, and so do ours; one that gets a gradient later is refused at step(), before anything moves."""

import copy

import pytest
import torch

import swapio.optim as so
from helpers.optim import SMALL_BUFFERS

CLASSES = ["OffloadAdamW", "OffloadAdam", "OffloadLion", "OffloadAdafactor"]
TORCH_TWIN = {"OffloadAdamW": torch.optim.AdamW, "OffloadAdam": torch.optim.Adam,
              "OffloadAdafactor": torch.optim.Adafactor}


def model_params():
    """[frozen int8, trainable fp32 matrix, frozen float64, trainable bf16 vector, frozen complex]."""
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randint(-100, 100, (6, 5), dtype=torch.int8, generator=g), requires_grad=False),
            torch.nn.Parameter(torch.randn(40, 30, generator=g)),
            torch.nn.Parameter(torch.randn(7, dtype=torch.float64, generator=g), requires_grad=False),
            torch.nn.Parameter(torch.randn(300, generator=g).bfloat16()),
            torch.nn.Parameter(torch.randn(4, dtype=torch.complex64, generator=g), requires_grad=False)]


def trainable(params):
    return [p for p in params if p.requires_grad]


def set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in trainable(params):
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def make(cls, params, mode, tmp_path, **kw):
    extra = {"swap_dir": tmp_path / "swap", **SMALL_BUFFERS} if mode == "nvme" else {}
    return getattr(so, cls)(params, offload=mode, lr=1e-2, **extra, **kw)


def run(opt, params, steps, first=0):
    for s in range(first, first + steps):
        set_grads(params, s)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", CLASSES)
def test_frozen_parameters_of_other_dtypes_are_taken_and_never_stepped(cls, mode, tmp_path):
    params, alone = model_params(), [p.detach().clone().requires_grad_(True) for p in trainable(model_params())]
    frozen_before = [p.detach().clone() for p in params if not p.requires_grad]
    with make(cls, params, mode, tmp_path) as opt, make(cls, alone, mode, tmp_path / "alone") as ref:
        run(opt, params, 3)
        run(ref, alone, 3)
        # the trainable ones step exactly as in an optimizer that never saw the frozen ones
        assert all(torch.equal(a, b) for a, b in zip(trainable(params), alone))
        assert all(torch.equal(a, b) for a, b in zip([p for p in params if not p.requires_grad], frozen_before))
        sd = opt.state_dict()
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3, 4]
    assert sorted(sd["state"]) == [1, 3]  # as torch's: state only for the parameters it stepped


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", ["OffloadAdamW", "OffloadAdafactor"])
def test_steps_and_state_dicts_match_torchs_optimizer_over_the_same_list(cls, mode, tmp_path):
    params, theirs = model_params(), model_params()
    fp32 = lambda ps: [ps[1]]  # noqa: E731 (torch keeps no fp32 master for the bf16 one: compare the fp32 one)
    ref = TORCH_TWIN[cls](theirs, lr=1e-2)
    with make(cls, params, mode, tmp_path) as opt:
        run(opt, params, 3)
        run(ref, theirs, 3)
        assert (fp32(params)[0] - fp32(theirs)[0]).abs().max() <= 1e-6 * fp32(theirs)[0].abs().max()
        ours_sd, theirs_sd = opt.state_dict(), ref.state_dict()
        assert ours_sd["param_groups"][0]["params"] == theirs_sd["param_groups"][0]["params"]
        assert sorted(ours_sd["state"]) == sorted(theirs_sd["state"])
        # (deep copies: a state dict holds the live state tensors, as torch's does)
        opt.load_state_dict(copy.deepcopy(theirs_sd))  # torch's state dict, frozen entries and all, loads
        ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # and ours into torch's
        run(opt, params, 1, first=3)
        run(ref, theirs, 1, first=3)
        assert (fp32(params)[0] - fp32(theirs)[0]).abs().max() <= 1e-6 * fp32(theirs)[0].abs().max()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_save_and_load_with_frozen_parameters_of_other_dtypes(mode, tmp_path):
    params = model_params()
    with make("OffloadAdamW", params, mode, tmp_path, state_dtype="int8") as opt:
        run(opt, params, 2)
        opt.save(tmp_path / "ckpt")
        saved = [p.detach().clone() for p in params]
        run(opt, params, 2, first=2)
        expected = [p.detach().clone() for p in params]
    for p, s in zip(params, saved):
        p.data.copy_(s)
    with make("OffloadAdamW", params, mode, tmp_path / "again", state_dtype="int8") as opt:
        opt.load(tmp_path / "ckpt")
        run(opt, params, 2, first=2)
    assert all(torch.equal(p, e) for p, e in zip(params, expected))


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("cls", CLASSES)
def test_a_taken_frozen_parameter_given_a_gradient_is_refused_before_anything_is_stepped(cls, mode, tmp_path):
    params = model_params()
    with make(cls, params, mode, tmp_path) as opt:
        run(opt, params, 1)
        before = [p.detach().clone() for p in params]
        steps = {k: v["step"].item() for k, v in opt.state_dict()["state"].items()}
        params[2].requires_grad_(True)  # the float64 one, unfrozen: torch would step it; we cannot
        set_grads(params, 1)
        assert params[2].grad is not None
        with pytest.raises(ValueError, match=r"parameter 2 of this .* taken frozen .*dtype torch.float64"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert {k: v["step"].item() for k, v in opt.state_dict()["state"].items()} == steps
        params[2].grad = None  # frozen again: steps on
        opt.step()
        assert not torch.equal(params[1], before[1])


def test_trainable_parameters_of_other_dtypes_are_still_refused_at_construction():
    with pytest.raises(ValueError, match=r"cannot optimize a parameter with dtype torch.float64"):
        so.OffloadAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])


def test_in_backward_updates_with_frozen_parameters_of_other_dtypes():
    """in_backward=True hooks the trainable parameters only; a frozen int8 weight in the list changes nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model.register_parameter("base", torch.nn.Parameter(torch.ones(3, dtype=torch.int8), requires_grad=False))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if k != "base"})
    x = torch.randn(4, 8)
    with so.OffloadAdamW(model.parameters(), in_backward=True, lr=1e-2) as opt, \
            so.OffloadAdamW(twin.parameters(), lr=1e-2) as ref:
        for _ in range(3):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            twin(x).square().sum().backward()
            ref.step()
            ref.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model[0].parameters(), twin[0].parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model[1].parameters(), twin[1].parameters()))


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.int8])
def test_nvme_mode_gives_frozen_parameters_no_room_and_no_io(base_dtype, tmp_path):
    """A LoRA-style list (frozen base weights between trainable adapters, as model.parameters() gives it): the
    swap file and each step's I/O are those of the adapters alone. Frozen ones were placed too: their room was
    read and written at every step wherever they shared a chunk with an adapter (65 times the I/O here)."""
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(6):
        params.append(torch.nn.Parameter(torch.randint(-9, 9, (256, 256), generator=g).to(base_dtype),
                                         requires_grad=False))
        params.append(torch.nn.Parameter(torch.randn(8, 256, generator=g)))
    adapters = [p.detach().clone().requires_grad_(True) for p in trainable(params)]
    with make("OffloadAdamW", params, "nvme", tmp_path) as opt, \
            make("OffloadAdamW", adapters, "nvme", tmp_path / "alone") as ref:
        run(opt, params, 2)
        run(ref, adapters, 2)
        assert all(torch.equal(a, b) for a, b in zip(trainable(params), adapters))
        ours, alone = opt.step_report()["last"], ref.step_report()["last"]
        assert (ours["bytes_read"], ours["bytes_written"]) == (alone["bytes_read"], alone["bytes_written"])
        assert opt.memory_report()["state_bytes"] == ref.memory_report()["state_bytes"]
        # after a load, too (nvme's load lays the state out afresh)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        run(opt, params, 1, first=2)
        run(ref, adapters, 1, first=2)
        assert all(torch.equal(a, b) for a, b in zip(trainable(params), adapters))
        assert opt.memory_report()["state_bytes"] == ref.memory_report()["state_bytes"]
        assert opt.step_report()["last"]["bytes_read"] == ref.step_report()["last"]["bytes_read"]


def test_a_frozen_parameter_given_a_gradient_by_hand_is_placed_and_stepped_as_torch_steps_it(tmp_path):
    """torch's optimizers step any listed parameter with a .grad, frozen or not; one of a dtype ours step is
    placed when it first gets one (frozen ones are not placed before)."""
    g = torch.Generator().manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(300, generator=g), requires_grad=False),
            torch.nn.Parameter(torch.randn(200, generator=g))]
    theirs = [p.detach().clone().requires_grad_(p.requires_grad) for p in ours]
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    with make("OffloadAdamW", ours, "nvme", tmp_path) as opt:
        for step in range(3):
            for a, b in zip(ours, theirs):
                if a.requires_grad or step > 0:  # the frozen one gets a gradient from the second step on
                    a.grad = torch.randn(a.shape, generator=g)
                    b.grad = a.grad.clone()
            opt.step()
            ref.step()
        assert all((a - b).abs().max() <= 1e-6 for a, b in zip(ours, theirs))
        assert sorted(opt.state_dict()["state"]) == [0, 1]


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_state_for_a_parameter_it_cannot_step_is_refused_at_load(mode, tmp_path):
    """torch's AdamW steps a float64 parameter and keeps its state after it is frozen; ours can never step it, and
    took that state silently: save() then wrote a checkpoint that load() refused ("'dtype' must be one of ...").
    Both loads refuse it now, naming the parameter, and leave the optimizer as it was."""
    params = model_params()
    params[2].requires_grad_(True)
    ref = torch.optim.AdamW(params, lr=1e-2)
    set_grads(params, 0)
    ref.step()
    params[2].requires_grad_(False)
    params[2].grad = None
    with make("OffloadAdamW", params, mode, tmp_path) as opt:
        run(opt, params, 1)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=r"state for parameter 2, .* cannot step: it has dtype torch.float64"):
            opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"] and sorted(after["state"]) == [1, 3]
        assert all(torch.equal(after["state"][k][f], before["state"][k][f]) for k in (1, 3) for f in before["state"][k])
        theirs = copy.deepcopy(ref.state_dict())
        del theirs["state"][2]
        opt.load_state_dict(theirs)  # without it, torch's state loads
        assert sorted(opt.state_dict()["state"]) == [1, 3]
    # a checkpoint saved while the parameter was an fp32 one, loaded where it is a frozen float64 one
    fp32 = model_params()
    fp32[2] = torch.nn.Parameter(fp32[2].detach().float())
    with make("OffloadAdamW", fp32, mode, tmp_path / "fp32") as opt:
        set_grads(fp32, 0)
        fp32[2].grad = torch.randn(7)
        opt.step()
        opt.save(tmp_path / "ckpt")
    with make("OffloadAdamW", params, mode, tmp_path / "again") as opt:
        with pytest.raises(ValueError, match=r"state for parameter 2, .* cannot step: it has dtype torch.float64"):
            opt.load(tmp_path / "ckpt")
        assert opt.state_dict()["state"] == {}


def test_a_trainable_parameter_put_in_a_group_by_an_edit_is_not_said_to_be_taken_frozen():
    """add_param_group refuses a trainable float64 parameter; one appended to a group's list is refused at step(),
    and the message says how it may have got there (it said only that it was taken frozen, which it was not)."""
    w, d = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    with so.OffloadAdamW([w]) as opt:
        opt.param_groups[0]["params"].append(d)
        w.grad, d.grad = torch.randn(4), torch.randn(3, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"parameter 1 .* put in param_groups by an edit.*dtype torch.float64"):
            opt.step()
        assert not opt.state_dict()["state"]


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_a_frozen_sharded_parameter_is_taken_by_adafactor_and_refused_once_it_has_a_gradient(mode, tmp_path):
    """OffloadAdafactor steps parameters whole, so a DTensor's shard (FSDP2) is refused; a frozen one (LoRA over a
    fully_shard model's base weights) was refused too, where torch's Adafactor takes it and never steps it.
    Stand-in for a DTensor: the attribute by which swapio recognises one (params.shard)."""
    sharded = torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False)
    sharded._local_tensor = torch.zeros(2, 6)
    params, alone = model_params(), [p.detach().clone().requires_grad_(True) for p in trainable(model_params())]
    with make("OffloadAdafactor", [sharded, *params], mode, tmp_path) as opt, \
            make("OffloadAdafactor", alone, mode, tmp_path / "alone") as ref:
        run(opt, params, 2)
        run(ref, alone, 2)
        assert all(torch.equal(a, b) for a, b in zip(trainable(params), alone))
        sharded.grad = torch.ones(4, 6)
        set_grads(params, 2)
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match=r"parameter 0 .* only its shard here \(a DTensor"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
    with pytest.raises(ValueError, match="DTensor"):  # a trainable one is still refused
        so.OffloadAdafactor([sharded.requires_grad_(True)])
